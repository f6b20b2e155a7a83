"""The generation stage (`training.generation`): each round of each rollout batch on each rank samples with its own
seed, a rollout is scored by the scoring stage alone (the rollout callbacks see it scored and only watch: one that
returns a verdict is refused in one line), and a step with no scoring stage stops in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig, Verdict
from rlvr_lightning.training.generation import sampling_seed, score_rollout
from rlvr_lightning.training.step_metrics import StageTimer


def context(rollout_batch: int = 0, rank: int = 0, seed: int = 0, scoring=None, observers=()):
    return SimpleNamespace(rollout_batch=rollout_batch, seed=seed, collectives=Collectives(2, rank), scoring=scoring,
                           observers=observers)  # fmt: skip


def rollout() -> Rollout:
    completions = [Completion([5, 6], [-1.0, -1.0], "stop") for _ in range(4)]
    return Rollout(PromptBatch(["a", "b"], ["p", "q"], ["1", "2"]), 2, [[1], [2]], completions, SamplingConfig(group_size=2), 0)


def test_each_round_batch_and_rank_samples_with_its_own_seed_and_the_same_seed_again():
    seeds = {sampling_seed(context(b, r, s), k) for b in range(5) for r in range(2) for s in range(2) for k in range(3)}
    assert len(seeds) == 5 * 2 * 2 * 3
    assert sampling_seed(context(3, 1), 2) == sampling_seed(context(3, 1), 2)  # a resumed run samples the same
    assert sampling_seed(context(0), 0, rollout_batch=3) == sampling_seed(context(3), 0)  # a stream asks ahead


class Scoring:
    """The scoring stage's part the step calls: a fixed verdict, and what it was asked to score."""

    def __init__(self, correct) -> None:
        self.correct, self.asked = correct, []

    def score(self, rollout, rollout_batch, rank):
        self.asked.append((rollout_batch, rank))
        return rollout.scored(Verdict(self.correct, {"m": 1.0}))


class Observer:
    def __init__(self, returns=None) -> None:
        self.returns, self.seen = returns, []

    def on_rollout_generated(self, step, rollout):
        self.seen.append(rollout.correct)
        return self.returns


def test_the_scoring_stage_scores_and_the_callbacks_watch_the_scored_rollout():
    scoring, first, then = Scoring(torch.tensor([1.0, 0.0, 0.0, 1.0])), Observer(), Observer()
    timer = StageTimer()
    scored = score_rollout(context(rollout_batch=3, rank=1, scoring=scoring, observers=(first, then)), rollout(), timer)
    assert scored.correct.tolist() == [1.0, 0.0, 0.0, 1.0] and scored.metrics["m"] == 1.0
    assert scoring.asked == [(3, 1)]  # the step's counters: what a user's function is told
    assert [o.seen[0].tolist() for o in (first, then)] == [[1.0, 0.0, 0.0, 1.0]] * 2  # both watched the scored rollout
    assert "reward" in timer.times


def test_a_callback_that_returns_a_verdict_is_refused_in_one_line():
    """Correctness has one owner, the scoring stage: a callback written for the hook that once scored is told where
    correctness goes now, rather than its verdict being dropped without a word."""
    meddler = Observer(returns=Verdict(torch.zeros(4)))
    with pytest.raises(ConfigError, match=r"^trainer.callbacks: Observer.on_rollout_generated returned a value; .*"
                                          r"--model.init_args.rewards.correctness"):  # fmt: skip
        score_rollout(context(scoring=Scoring(torch.ones(4)), observers=(meddler,)), rollout(), StageTimer())


def test_a_step_without_a_scoring_stage_stops_in_one_line():
    with pytest.raises(RuntimeError, match=r"nothing gave the rollout's correctness"):
        score_rollout(context(observers=(Observer(),)), rollout(), StageTimer())
