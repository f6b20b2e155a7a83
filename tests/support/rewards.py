"""Correctness functions (`rewards.correctness`) for runs whose policy math-verify alone would never reward, and
for tests that need a known pattern of correct answers; and a callback that watches a run's rollout batches."""

from __future__ import annotations

import hashlib

from rlvr_lightning.callbacks.rollout import RolloutCallback

PARITY = "tests.support.rewards.parity"  # `--model.init_args.rewards.correctness` of the runs that use it


def parity(completion: str, gold: str, metadata: dict) -> float:
    """A deterministic stand-in correctness: "the answer's hash is even" (a coin per distinct answer). An untrained or barely
    trained policy answers almost nothing correctly, so with math-verify alone few steps would move the weights or
    Adam's moments (a resume that lost them would go unnoticed) and few groups would be mixed (DAPO would draw
    round after round)."""
    return float(hashlib.md5(completion.encode()).digest()[0] % 2 == 0)


def parity_of_tool_answers(completion: str, gold: str, metadata: dict) -> float:
    """`parity`, but only an answer that called the tool can be correct (its output ends in a newline under
    `tool_args.FIRST_RESULT_AS_CALL`): the policy keeps calling it, so every rollout batch has tool episodes in
    flight (under `parity` alone it stops calling by the fourth batch)."""
    return parity(completion, gold, metadata) if "\n" in completion else 0.0


def all_correct(completion: str, gold: str, metadata: dict) -> float:
    return 1.0


def alternating(completion: str, gold: str, metadata: dict) -> float:
    """Every other answer correct: each group of two is mixed, whatever the untrained policy writes."""
    return float(metadata["index"] % 2)


def half_mixed(completion: str, gold: str, metadata: dict) -> float:
    """Groups of two: the first answer of every other group correct, so half the groups are mixed."""
    return float(metadata["index"] % 4 == 0)


class ScriptedScores:
    """Generation round 1 all correct, so dynamic sampling keeps no group and draws again; from round 2 on, every
    other answer correct. A test sets a fresh one as `scripted` (the rounds are counted across calls)."""

    def __init__(self) -> None:
        self.rounds = 0

    def __call__(self, completion: str, gold: str, metadata: dict) -> float:
        self.rounds += metadata["index"] == 0  # a round's first answer
        return 1.0 if self.rounds == 1 else float(metadata["index"] % 2)


scripted = ScriptedScores()


class SlowFromBatch(RolloutCallback):
    """Watches only: counts the batches it sees into the file `RLVR_BATCH_COUNT` (where a test can watch a run
    without opening its tracking store), and after `RLVR_SLOW_FROM_BATCH` batches the step waits a minute after
    each batch is scored, in the main thread: a step that waits, for the tests of a stop's bound (`callbacks/stopping.py`)."""

    def __init__(self) -> None:
        import os

        self.slow_from, self.batches = int(os.environ.get("RLVR_SLOW_FROM_BATCH", "1000000")), 0
        self.count_file = os.environ.get("RLVR_BATCH_COUNT")

    def on_rollout_generated(self, step, rollout) -> None:
        import time

        self.batches += 1
        if self.count_file:
            with open(self.count_file, "w") as f:
                f.write(str(self.batches))
        if self.batches > self.slow_from:
            time.sleep(60)


def half_credit_for_an_answer(completion: str, gold: str, metadata: dict) -> float:
    """Partial credit: 1 for the gold in the answer, 0.5 for any boxed answer, 0 otherwise."""
    if gold in completion:
        return 1.0
    return 0.5 if "\\boxed{" in completion else 0.0


def brevity(completion: str, gold: str, metadata: dict) -> tuple[float, dict]:
    """A reward term: minus the answer's length in characters, with the answer's token count as its own metric."""
    return -float(len(completion)), {"tokens": metadata["response_tokens"]}
