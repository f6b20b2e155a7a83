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


def test_a_completions_sampled_mask_is_always_one_bool_per_token():
    """The engine's completions are all sampled without saying so; a mask of another length is refused."""
    assert Completion([5, 6, 7], [-0.5] * 3, "stop").sampled_mask == [True, True, True]
    assert Completion([], [], "length").sampled_mask == []
    inserted = Completion([5, 6, 7], [-0.5, 0.0, -0.5], "stop", sampled_mask=[True, False, True])
    assert inserted.num_sampled == 2 and inserted.has_inserted and not two_sequences().completions[0].has_inserted
    with pytest.raises(ValueError, match="sampled_mask has 2 entries for its 3 tokens"):
        Completion([5, 6, 7], [-0.5] * 3, "stop", sampled_mask=[True, False])


def test_the_rollout_tensors_always_carry_the_sampled_mask_zero_on_inserted_tokens_and_padding():
    rollout = two_sequences()
    plain = rollout.tensors(pad_id=0)
    assert torch.equal(plain.sampled_mask, plain.response_mask)  # nothing inserted: there all the same
    comps = [dataclasses.replace(rollout.completions[0], sampled_mask=[False, True]), rollout.completions[1]]
    t = dataclasses.replace(rollout, completions=comps).tensors(pad_id=0)
    assert t.sampled_mask.tolist() == [[0.0, 1.0], [1.0, 0.0]] and t.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert t.select(torch.tensor([1])).sampled_mask.tolist() == [[1.0, 0.0]]
    assert t.trimmed().sampled_mask.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_a_completion_saved_in_a_checkpoint_loads_weights_only_and_so_does_one_saved_before_the_mask(tmp_path):
    """A stream's checkpoint holds completions as dicts of their fields (`asdict`); one written before
    `sampled_mask` holds `sampled` (1/0 per token, empty where every token was sampled)."""
    c = Completion([5, 6, 7], [-0.5, 0.0, -0.5], "stop", [0, 0, 1], sampled_mask=[True, False, True], excluded="x")
    torch.save({"c": dataclasses.asdict(c)}, tmp_path / "ckpt")
    assert Completion.from_state(torch.load(tmp_path / "ckpt", weights_only=True)["c"]) == c
    old = {k: v for k, v in dataclasses.asdict(c).items() if k != "sampled_mask"}
    assert Completion.from_state({**old, "sampled": [1, 0, 1]}) == c
    assert Completion.from_state({**old, "sampled": []}).sampled_mask == [True, True, True]
