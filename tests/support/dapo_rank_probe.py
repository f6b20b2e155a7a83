"""What the 2-rank DAPO test (test_dynamic_sampling_ranks.py) loads into the CLI run: a stand-in correctness that
makes the ranks' dynamic sampling disagree (`rewards.correctness`), and a callback that records what each rank did."""

from __future__ import annotations

import json
from pathlib import Path

from rlvr_lightning.callbacks.rollout import RolloutCallback

UNEVEN = "tests.support.dapo_rank_probe.uneven"  # `--model.init_args.rewards.correctness`


class UnevenCorrectness:
    """Rank 0's first generation round of every step has no mixed group; every other round (all of rank 1's) has
    only mixed groups. Without agreement rank 1 would train after one round while rank 0 draws a second: the ranks'
    sharded `generate` and update collectives would fall out of step. Each rank is a process of its own, with its
    own count of rounds."""

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}  # rollout batch → generation rounds scored
        self.last_id = None

    def __call__(self, completion: str, gold: str, metadata: dict) -> float:
        step, index = metadata["rollout_batch"], metadata["index"]
        if index == 0:  # a round's first answer
            self.rounds[step] = self.rounds.get(step, 0) + 1
        first_of_group = index == 0 or metadata["id"] != self.last_id  # the G answers to a prompt are side by side
        self.last_id = metadata["id"]
        if metadata["rank"] == 0 and self.rounds[step] == 1:
            return 0.0
        return float(first_of_group)  # one correct answer per group


uneven = UnevenCorrectness()


class RoundRecord(RolloutCallback):
    """The prompt ids of each rank's generation rounds, per step, and the policy version it ended at."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.rounds: dict[int, list[list[str]]] = {}  # step → prompt ids of each round

    def on_rollout_generated(self, step, rollout) -> None:
        self.rounds.setdefault(step.rollout_batch, []).append(list(rollout.batch.ids))

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"rounds": {str(k): v for k, v in self.rounds.items()}, "policy_version": pl_module.session.policy_version}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
