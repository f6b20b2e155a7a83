"""A rollout is a value: nothing writes into it once made; scoring makes a new one."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig, Verdict


def two_sequences() -> Rollout:
    comps = [Completion([5, 6], [-0.5, -0.5], "stop"), Completion([7], [-0.1], "length")]
    return Rollout(PromptBatch(["p"], ["q"], ["1"]), 2, [[1, 2]], comps, SamplingConfig(2), 0, ["a", "b"],
                   metrics={"rollout_tokens": 3.0})  # fmt: skip


def test_a_rollout_cannot_be_modified_after_construction():
    rollout = two_sequences()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.correct = torch.ones(2)
    with pytest.raises(TypeError):
        rollout.metrics["rewards_mean"] = 1.0
    with pytest.raises(AttributeError):
        rollout.completions.append(Completion([1], [0.0], "stop"))
    with pytest.raises(TypeError):
        rollout.texts[0] = "changed"


def test_scoring_makes_a_new_rollout_and_leaves_the_generated_one_as_it_was():
    rollout = two_sequences()
    scored = rollout.scored(Verdict(torch.tensor([1.0, 0.0]), {"verifier_timeouts_total": 0.0}))
    assert rollout.correct is None and dict(rollout.metrics) == {"rollout_tokens": 3.0}
    assert scored.correct.tolist() == [1.0, 0.0]
    assert dict(scored.metrics) == {"rollout_tokens": 3.0, "verifier_timeouts_total": 0.0}
    assert scored.completions == rollout.completions and scored.texts == ("a", "b")


def test_a_rollout_pickles_and_copies():
    """The stream's checkpoints and the FSDP tests' recordings save rollouts; the copy stays read-only."""
    scored = two_sequences().scored(Verdict(torch.tensor([1.0, 0.0])))
    for again in (pickle.loads(pickle.dumps(scored)), copy.deepcopy(scored)):
        assert again.correct.tolist() == [1.0, 0.0] and dict(again.metrics) == {"rollout_tokens": 3.0}
        with pytest.raises(TypeError):
            again.metrics["x"] = 1.0
