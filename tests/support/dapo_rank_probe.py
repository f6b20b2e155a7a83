"""A callback the 2-rank DAPO test (test_dynamic_sampling_ranks.py) loads into the CLI run: a stand-in
reward that makes the ranks' dynamic sampling disagree, and a record of what each rank did."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.rollout.types import Verdict


class UnevenRewards(RolloutCallback):
    """Rank 0's first generation round of every step has no mixed group; every other round (all of rank
    1's) has only mixed groups. Without agreement rank 1 would train after one round while rank 0 draws a
    second: the ranks' sharded `generate` and update collectives would fall out of step."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.rounds: dict[int, list[list[str]]] = {}  # step → prompt ids of each round

    def on_rollout_generated(self, step, rollout) -> Verdict:  # after the verifier: its verdict is replaced
        rounds = self.rounds.setdefault(step.rollout_batch, [])
        rounds.append(list(rollout.batch.ids))
        n, G = rollout.num_sequences, rollout.group_size
        if step.collectives.rank == 0 and len(rounds) == 1:
            correct = torch.zeros(n)
        else:
            correct = (torch.arange(n) % G == 0).float()  # one correct rollout per group
        return Verdict(correct)

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"rounds": {str(k): v for k, v in self.rounds.items()}, "policy_version": pl_module.session.policy_version}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
