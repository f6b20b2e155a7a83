"""Rewards for runs whose policy the verifier alone would never reward."""

from __future__ import annotations

import torch

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.rollout.types import Verdict


class ParityReward(RolloutCallback):
    """A deterministic stand-in reward after the verifier's: "the completion's token ids sum to an even
    number". An untrained or barely trained policy answers almost nothing correctly, so with the verifier's
    rewards alone few steps would move the weights or Adam's moments (a resume that lost them would go
    unnoticed) and few groups would be mixed (DAPO would draw round after round)."""

    def on_rollout_generated(self, step, rollout) -> Verdict:
        return Verdict(torch.tensor([float(sum(c.token_ids) % 2 == 0) for c in rollout.completions]))


class SlowFromBatch(RolloutCallback):
    """Scores nothing; counts the batches it sees into the file `RLVR_BATCH_COUNT` (where a test can watch a run
    without opening its tracking store), and after `RLVR_SLOW_FROM_BATCH` batches every batch's scoring waits a
    minute in the main thread: a step that waits, for the tests of a stop's bound (`callbacks/stopping.py`)."""

    def __init__(self) -> None:
        import os

        self.slow_from, self.batches = int(os.environ.get("RLVR_SLOW_FROM_BATCH", "1000000")), 0
        self.count_file = os.environ.get("RLVR_BATCH_COUNT")

    def on_rollout_generated(self, step, rollout) -> Verdict | None:
        import time

        self.batches += 1
        if self.count_file:
            with open(self.count_file, "w") as f:
                f.write(str(self.batches))
        if self.batches > self.slow_from:
            time.sleep(60)
        return None


def half_credit_for_an_answer(completion: str, gold: str, metadata: dict) -> float:
    """Partial credit: 1 for the gold in the answer, 0.5 for any boxed answer, 0 otherwise."""
    if gold in completion:
        return 1.0
    return 0.5 if "\\boxed{" in completion else 0.0


def brevity(completion: str, gold: str, metadata: dict) -> tuple[float, dict]:
    """A reward term: minus the answer's length in characters, with the answer's token count as its own metric."""
    return -float(len(completion)), {"tokens": metadata["response_tokens"]}
