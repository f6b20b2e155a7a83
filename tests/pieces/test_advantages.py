"""RLOO's, pass@k's and MaxRL's advantages against their formulas and invariants, on groups small enough to
check by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import advantage_estimators
from rlvr_lightning.pieces.kinds import AdvantageInputs

G = 4
# Four groups: one correct, two correct, all correct, none correct.
CORRECT = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])


def advantages(name: str, rewards: torch.Tensor, correct: torch.Tensor = CORRECT, **knobs) -> torch.Tensor:
    return advantage_estimators.get(name).fn(AdvantageInputs(rewards, correct, G), **knobs)


def test_rloo_subtracts_the_mean_of_the_other_rollouts():
    r = torch.tensor([1.0, 0.5, 0.0, 2.0, 3, 3, 3, 3])
    adv = advantages("rloo", r, torch.zeros(8))
    by_hand = [1.0 - (0.5 + 0 + 2) / 3, 0.5 - (1 + 0 + 2) / 3, 0 - (1 + 0.5 + 2) / 3, 2 - (1 + 0.5 + 0) / 3, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(by_hand))


def test_rloo_is_group_size_over_group_size_minus_one_times_the_unscaled_centred_advantage():
    r = torch.randn(4 * G, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(advantages("rloo", r, torch.zeros(4 * G)), advantages("dr-grpo", r) * G / (G - 1))


def test_pass_at_k_by_hand_for_k_2():
    adv = advantages("pass-at-k", CORRECT, pass_at_k=2).view(-1, G)
    # One correct of 4: R̄ = 1 − C(3,2)/C(4,2) = 1/2, σ = 1/2; correct (1 − 1/2)/σ = 1;
    # incorrect (1 − 1/2 − C(2,1)/C(3,1))/σ = −1/3.
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # Two correct: R̄ = 5/6, σ = √5/6; ±(1/6)/σ = ±1/√5.
    torch.testing.assert_close(adv[1], torch.tensor([1, 1, -1, -1]) / math.sqrt(5))
    assert (adv[2:] == 0).all()  # all correct, all wrong: no signal


def test_pass_at_1_is_the_mean_reward_baseline_over_the_population_std():
    adv = advantages("pass-at-k", CORRECT, pass_at_k=1).view(-1, G)
    R = CORRECT.view(-1, G)
    expected = (R - R.mean(1, keepdim=True)) / R.std(1, unbiased=False, keepdim=True).clamp(min=1e-12)
    torch.testing.assert_close(adv[:2], expected[:2])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pass_at_k_advantages_sum_to_zero_in_every_group(k):
    correct = (torch.rand(64 * 8, generator=torch.Generator().manual_seed(k)) < 0.4).float()
    adv = advantage_estimators.get("pass-at-k").fn(AdvantageInputs(correct, correct, 8), pass_at_k=k)
    torch.testing.assert_close(adv.view(-1, 8).sum(1), torch.zeros(64), atol=1e-5, rtol=0)


def test_pass_at_k_larger_than_the_group_is_an_error():
    with pytest.raises(ConfigError, match=r"pass_at_k must lie in \[1, rollout.group_size=4\], got 5"):
        advantage_estimators.get("pass-at-k").check_knobs({"pass_at_k": 5}, run={"group_size": 4})


def test_reinforce_pp_is_the_group_centred_reward_whitened_over_the_batch_tokens():
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    lengths = torch.tensor([2.0, 4, 1, 1, 3, 3, 2, 8])
    x = AdvantageInputs(r, r, G, lengths=lengths)
    adv = advantage_estimators.get("reinforce-pp").fn(x)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    tokens = centred.repeat_interleave(lengths.long())  # every response token carries its sequence's value
    torch.testing.assert_close(adv, (centred - tokens.mean()) / tokens.std(unbiased=False))
    torch.testing.assert_close((adv * lengths).sum() / lengths.sum(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_reinforce_pp_whitens_over_all_ranks_as_over_their_union():
    r = (torch.rand(32, generator=torch.Generator().manual_seed(0)) < 0.5).float()
    lengths = torch.randint(1, 20, (32,), generator=torch.Generator().manual_seed(1)).float()
    whole = advantage_estimators.get("reinforce-pp").fn(AdvantageInputs(r, r, G, lengths=lengths))
    halves = [slice(0, 12), slice(12, 32)]  # two ranks with whole groups, unequal shares
    totals = sum(reinforce_sums(r[h], lengths[h]) for h in halves)  # what the all-reduce returns
    for h in halves:
        x = AdvantageInputs(r[h], r[h], G, reduce_sum=lambda mine: totals.to(mine.dtype), lengths=lengths[h])
        torch.testing.assert_close(advantage_estimators.get("reinforce-pp").fn(x), whole[h])


def reinforce_sums(r, lengths):
    """The rank's share of the reduction: (Σ L, Σ L·Ã, Σ L·Ã²), captured from the estimator's own call."""
    seen = []
    advantage_estimators.get("reinforce-pp").fn(
        AdvantageInputs(r, r, G, reduce_sum=lambda mine: seen.append(mine) or mine, lengths=lengths)
    )
    return seen[0]


# ---- MaxRL -----------------------------------------------------------------------------------------------
def maxrl(rewards: list[float], G: int) -> list[float]:
    x = torch.tensor(rewards)
    return advantage_estimators.get("maxrl").fn(AdvantageInputs(x, (x > 0).float(), G)).tolist()


def test_maxrl_divides_the_centred_reward_by_the_group_mean():
    assert maxrl([1, 0, 0, 0, 1, 1, 0, 0], 4) == [3.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]  # G/K − 1, −1
    assert maxrl([0, 0, 1, 1], 2) == [0.0, 0.0, 0.0, 0.0]  # no success, or all: no signal
    scaled = maxrl([0.5, 0, 0.25, 0.25], 4)  # r/r̄ − 1, invariant to scaling r
    assert scaled == pytest.approx(maxrl([2, 0, 1, 1], 4)) and sum(scaled) == pytest.approx(0)
