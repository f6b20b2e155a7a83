"""The generation stage (`training.generation`): each round of each rollout batch on each rank samples with its own
seed, a rollout is scored by the scorers in order (a later one sees an earlier one's verdict), and a rollout nobody
scored stops the step in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig, Verdict
from rlvr_lightning.training.generation import sampling_seed, score_rollout
from rlvr_lightning.training.step_metrics import StageTimer


def context(rollout_batch: int = 0, rank: int = 0, seed: int = 0, scorers=()):
    return SimpleNamespace(rollout_batch=rollout_batch, seed=seed, collectives=Collectives(2, rank), scorers=scorers, scoring=None)


def rollout() -> Rollout:
    completions = [Completion([5, 6], [-1.0, -1.0], "stop") for _ in range(4)]
    return Rollout(PromptBatch(["a", "b"], ["p", "q"], ["1", "2"]), 2, [[1], [2]], completions, SamplingConfig(group_size=2), 0)


def test_each_round_batch_and_rank_samples_with_its_own_seed_and_the_same_seed_again():
    seeds = {sampling_seed(context(b, r, s), k) for b in range(5) for r in range(2) for s in range(2) for k in range(3)}
    assert len(seeds) == 5 * 2 * 2 * 3
    assert sampling_seed(context(3, 1), 2) == sampling_seed(context(3, 1), 2)  # a resumed run samples the same
    assert sampling_seed(context(0), 0, rollout_batch=3) == sampling_seed(context(3), 0)  # a stream asks ahead


class Scorer:
    def __init__(self, correct=None, terms=None, seen=None) -> None:
        self.correct, self.terms, self.seen = correct, terms or {}, seen

    def on_rollout_generated(self, step, rollout):
        if self.seen is not None:
            self.seen.append(rollout.correct)
        return Verdict(self.correct, {f"m{len(self.terms)}": 1.0}, self.terms)


def test_scorers_score_in_order_and_the_stage_is_timed():
    seen: list = []
    first = Scorer(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    then = Scorer(None, {"brevity": torch.full((4,), 0.5)}, seen)  # reward terms only: correctness stays the first's
    timer = StageTimer()
    scored = score_rollout(context(scorers=(first, then)), rollout(), timer)
    assert seen[0].tolist() == [1.0, 0.0, 0.0, 1.0]  # the later scorer saw the earlier verdict
    assert scored.correct.tolist() == [1.0, 0.0, 0.0, 1.0] and scored.reward_terms["brevity"].tolist() == [0.5] * 4
    assert "reward" in timer.times


def test_a_rollout_nobody_scores_stops_the_step_in_one_line():
    with pytest.raises(RuntimeError, match=r"nothing gave the rollout's correctness"):
        score_rollout(context(scorers=(Scorer(None),)), rollout(), StageTimer())
