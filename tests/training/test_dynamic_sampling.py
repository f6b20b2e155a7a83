"""Dynamic sampling (`training.dynamic_sampling`, DAPO's): rounds of generation until the target number of groups
with mixed correctness is found, judged on correctness only, in generation order, and what happens at the round
limit (docs/algorithms.md#dynamic-sampling)."""

from __future__ import annotations

import logging

import pytest
import torch

from rlvr_lightning.pieces.advantages import group_advantage, mixed_groups, overlong_penalty
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.dynamic_sampling import DynamicSamplingExhausted, dynamic_sample


def test_dynamic_sampling_drops_an_all_correct_group_whose_shaped_rewards_differ():
    """docs/algorithms.md#dynamic-sampling: groups are judged on correctness c, never on the shaped reward.
    Group 0 is all correct, but DAPO's overlong penalty gives its longer rollout a lower reward (1 vs 0);
    group 1 is mixed. Only group 1 may be kept."""
    rollout = scored_rollout([[1, 1], [1, 0]], 0)  # response lengths 1, 2 in each group
    shaped = (2 * rollout.correct - 1) + overlong_penalty(rollout.response_lengths, 2, 1)
    assert shaped.tolist() == [1.0, 0.0, 1.0, -2.0]
    assert (group_advantage(shaped, 2)[:2] != 0).all()  # the shaped reward does differ in group 0
    assert mixed_groups(rollout.correct, 2).tolist() == [False, True]
    kept, stats = dynamic_sample(lambda k: rollout, target_groups=1, max_rounds=1)
    assert kept.batch.ids == ["r0p1"] and kept.correct.tolist() == [1.0, 0.0]
    assert stats.groups_kept == 1 and not stats.exhausted


def scored_rollout(correct_rows: list[list[int]], round_index: int) -> Rollout:
    """A rollout with the given correctness per group (the verifier's output), as one engine round returns."""
    G = len(correct_rows[0])
    B = len(correct_rows)
    ids = [f"r{round_index}p{b}" for b in range(B)]
    comps = [Completion([5, 6, 7][: 1 + (j % 3)], [-0.5] * (1 + (j % 3)), "stop") for _ in range(B) for j in range(G)]
    correct = torch.tensor([float(c) for row in correct_rows for c in row])
    return Rollout(
        batch=PromptBatch(ids, [f"q{i}" for i in ids], ["1"] * B), group_size=G, prompt_ids=[[1, 2]] * B,
        completions=comps, sampling=SamplingConfig(group_size=G), policy_version=3, texts=["t"] * (B * G),
        correct=correct, metrics={"verifier_timeouts_total": float(round_index)},
    )  # fmt: skip


def random_rounds(seed: int, B: int, G: int, p_correct: float):
    g = torch.Generator().manual_seed(seed)
    calls = []

    def draw(k: int) -> Rollout:
        calls.append(k)
        rows = (torch.rand(B, G, generator=g) < p_correct).int().tolist()
        return scored_rollout(rows, k)

    return draw, calls


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_sampling_keeps_exactly_the_target_and_never_an_all_equal_group(seed):
    draw, calls = random_rounds(seed, B=6, G=4, p_correct=0.2)
    rollout, stats = dynamic_sample(draw, target_groups=8, max_rounds=50)
    assert len(rollout.batch) == 8 and rollout.num_sequences == 32 and len(rollout.texts) == 32
    assert mixed_groups(rollout.correct, 4).all()
    R = rollout.correct.view(-1, 4)
    assert (R.max(1).values != R.min(1).values).all()
    assert stats.rounds == len(calls) >= 2 and not stats.exhausted
    assert 0 < stats.metrics()["dynamic_sampling_filtered_frac"] < 1
    assert len(rollout.prompt_ids) == 8 and rollout.metrics["verifier_timeouts_total"] == stats.rounds - 1


def test_dynamic_sampling_stops_at_its_round_limit_with_a_warning(caplog):
    draw, calls = random_rounds(0, B=4, G=4, p_correct=0.0)  # nothing is ever mixed
    with caplog.at_level(logging.WARNING, logger="rlvr_lightning.training.dynamic_sampling"):
        rollout, stats = dynamic_sample(draw, target_groups=2, max_rounds=3, on_exhausted="train_partial")
    assert rollout is None and calls == [0, 1, 2] and stats.exhausted
    assert "found 0 of 2 groups" in caplog.text and "3 generation rounds" in caplog.text


def test_dynamic_sampling_partial_batch_and_error_mode():
    rounds = [[[1, 0], [1, 1]], [[0, 0], [0, 0]]]  # one mixed group in two rounds; the target is 2
    draw = lambda k: scored_rollout(rounds[k], k)  # noqa: E731
    rollout, stats = dynamic_sample(draw, target_groups=2, max_rounds=2, on_exhausted="train_partial")
    assert len(rollout.batch) == 1 and rollout.correct.tolist() == [1.0, 0.0] and stats.exhausted
    with pytest.raises(DynamicSamplingExhausted, match="max_num_gen_batches"):
        dynamic_sample(draw, target_groups=2, max_rounds=2, on_exhausted="error")


def test_dynamic_sampling_takes_groups_in_generation_order():
    rounds = [[[1, 0], [0, 0], [0, 1]], [[1, 0], [1, 1], [1, 0]]]
    draw = lambda k: scored_rollout(rounds[k], k)  # noqa: E731
    rollout, stats = dynamic_sample(draw, target_groups=3, max_rounds=0)
    assert rollout.batch.ids == ["r0p0", "r0p2", "r1p0"]
    assert stats.rounds == 2 and stats.groups_generated == 6 and stats.groups_kept == 4
