"""The pieces the field adopted lately, each against its paper's formula on hand-checkable tensors:
dual-clip PPO, DPPO's trust-region masks, DRO, MaxRL, seq-mean-token-sum, and the rollout corrections
tis-geo, OPSM and KPop."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.pieces.kinds import (
    AdvantageInputs,
    CorrectionInputs,
    OptimizerStepNorms,
    TokenLossInputs,
    advantage_estimators,
    loss_aggregators,
    policy_losses,
    rollout_corrections,
)


def loss(name: str, logp, old_logp, adv, mask=None, **knobs):
    mask = torch.ones_like(logp) if mask is None else mask
    bound = policy_losses.get(name).bind(knobs)  # the others at the loss's own defaults (a clip range 0.2 / 0.2)
    return bound(TokenLossInputs(logp, old_logp, adv, mask))


# ---- dual-clip PPO --------------------------------------------------------------------------------------
def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_their_size():
    ratio = torch.tensor([[0.5, 1.5, 2.5, 4.0, 2.9]])
    logp = ratio.log().requires_grad_()
    adv = torch.full((1, 5), -2.0)
    per_tok, stats = loss("ppo-clip", logp, torch.zeros(1, 5), adv, dual_clip_c=3.0)
    # PPO: max(2ρ, 2·clip(ρ, 0.8, 1.2)) = 1.6, 3, 5, 8, 5.8; the dual clip caps it at c·|Â| = 6.
    torch.testing.assert_close(per_tok, torch.tensor([[1.6, 3.0, 5.0, 6.0, 5.8]]))
    assert stats["clipped_dual"].tolist() == [[False, False, False, True, False]]
    per_tok.sum().backward()
    # d(2ρ)/d log π = 2ρ where the unclipped branch acts; nothing past the cap or inside the lower clip.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 3.0, 5.0, 0.0, 5.8]]))


def test_dual_clip_leaves_positive_advantages_and_the_default_alone():
    logp, old = torch.tensor([[0.1, 1.6, -0.7]]), torch.zeros(1, 3)
    for adv in (torch.ones(1, 3), -torch.ones(1, 3)):
        plain, _ = loss("ppo-clip", logp, old, adv)
        off, stats = loss("ppo-clip", logp, old, adv, dual_clip_c=None)
        assert torch.equal(plain, off) and "clipped_dual" not in stats
    positive, _ = loss("ppo-clip", logp, old, torch.ones(1, 3), dual_clip_c=3.0)
    assert torch.equal(positive, loss("ppo-clip", logp, old, torch.ones(1, 3))[0])


def test_dual_clip_on_gspo_acts_on_the_sequence_ratio():
    # Sequence log-ratio mean(log 4, log 4) = log 4: s = 4 > c = 3, Â = −1: every token's term is capped at 3.
    logp = torch.full((1, 2), math.log(4.0))
    per_tok, stats = loss("gspo", logp, torch.zeros(1, 2), -torch.ones(1, 2), dual_clip_c=3.0)
    torch.testing.assert_close(per_tok, torch.full((1, 2), 3.0))
    assert stats["clipped_dual"].all()


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_needs_c_above_one(c):
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_losses.get("ppo-clip").check_knobs({"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": c})


# ---- DPPO ------------------------------------------------------------------------------------------------
def probs(pi: list[float], mu: list[float]):
    logp = torch.tensor([pi]).log().requires_grad_()
    return logp, torch.tensor([mu]).log()


@pytest.mark.parametrize("adv, masked", [(1.0, [True, False, False]), (-1.0, [False, True, False])])
def test_dppo_tv_masks_only_the_direction_the_advantage_pushes(adv, masked):
    # π − μ: +0.2 (left the region upwards), −0.2 (downwards), +0.009 (a rare token whose ratio is 10).
    logp, old = probs([0.7, 0.3, 0.01], [0.5, 0.5, 0.001])
    A = torch.full((1, 3), adv)
    per_tok, stats = loss("dppo-tv", logp, old, A, clip_eps_low=0.15, clip_eps_high=0.15)
    assert (stats["clipped_high"] | stats["clipped_low"]).tolist() == [masked]
    per_tok.sum().backward()
    ratio = torch.tensor([0.7 / 0.5, 0.3 / 0.5, 10.0])
    expected = torch.where(torch.tensor(masked), 0.0, -adv * ratio)  # −Â·min(r, C) on the kept, C = 10
    torch.testing.assert_close(logp.grad, expected[None], rtol=1e-4, atol=1e-6)


def test_dppo_kl_uses_the_binary_kl_of_the_sampled_token():
    # μ = 0.5: π = 0.6 → D = 0.0204 (kept), 0.8 → 0.2231 (up), 0.3 → 0.0872 (down); δ = 0.05.
    logp, old = probs([0.6, 0.8, 0.3], [0.5, 0.5, 0.5])
    up, stats_up = loss("dppo-kl", logp, old, torch.ones(1, 3), clip_eps_low=0.05, clip_eps_high=0.05)
    down, stats_down = loss("dppo-kl", logp, old, -torch.ones(1, 3), clip_eps_low=0.05, clip_eps_high=0.05)
    assert stats_up["clipped_high"].tolist() == [[False, True, False]]
    assert stats_down["clipped_low"].tolist() == [[False, False, True]]
    # KL(μ‖π) = 0.0872 at π = 0.3, KL(π‖μ) = 0.0823: a δ between them tells the direction apart.
    _, between = loss("dppo-kl", logp, old, -torch.ones(1, 3), clip_eps_low=0.085, clip_eps_high=0.085)
    assert between["clipped_low"].tolist() == [[False, False, True]]


def test_dppo_caps_the_ratio_weight():
    logp, old = probs([0.01], [0.001])
    per_tok, _ = loss("dppo-tv", logp, old, -torch.ones(1, 1), dppo_ratio_cap=3.0)
    per_tok.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[3.0]]))


# ---- DRO -------------------------------------------------------------------------------------------------
def test_dro_gradient_is_minus_the_advantage_plus_beta_times_the_log_ratio():
    d = torch.tensor([[0.0, 0.5, -0.2]])
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = (old + d).requires_grad_()
    A = torch.tensor([[1.0, 0.5, -1.0]])
    per_tok, _ = loss("dro", logp, old, A, dro_beta=1.0)
    torch.testing.assert_close(per_tok, -(A * logp - 0.5 * d**2))
    per_tok.sum().backward()
    # −Â + β·d; the second token sits where the log-ratio reached Â/β: no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.0, 0.8]]))


# ---- MaxRL -----------------------------------------------------------------------------------------------
def maxrl(rewards: list[float], G: int) -> list[float]:
    x = torch.tensor(rewards)
    return advantage_estimators.get("maxrl").fn(AdvantageInputs(x, (x > 0).float(), G)).tolist()


def test_maxrl_divides_the_centred_reward_by_the_group_mean():
    assert maxrl([1, 0, 0, 0, 1, 1, 0, 0], 4) == [3.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]  # G/K − 1, −1
    assert maxrl([0, 0, 1, 1], 2) == [0.0, 0.0, 0.0, 0.0]  # no success, or all: no signal
    scaled = maxrl([0.5, 0, 0.25, 0.25], 4)  # r/r̄ − 1, invariant to scaling r
    assert scaled == pytest.approx(maxrl([2, 0, 1, 1], 4)) and sum(scaled) == pytest.approx(0)


# ---- seq-mean-token-sum ----------------------------------------------------------------------------------
def test_seq_mean_token_sum_sums_each_sequence_and_averages_over_the_steps_sequences():
    per_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9 is padding
    norms = OptimizerStepNorms(num_seqs=4.0, num_tokens=5.0, num_groups=1.0, num_mixed_seqs=0.0, world_size=2, norm_const=3.0)
    # (6 + 9) / 4 sequences of the whole step, × 2 ranks (undoing the gradient averaging).
    assert loss_aggregators.get("seq-mean-token-sum").fn(per_tok, mask, norms).item() == pytest.approx(15 / 4 * 2)


# ---- rollout corrections: tis-geo, OPSM, KPop ------------------------------------------------------------
def correction(name: str, old: list[list[float]], rollout: list[list[float]], mask=None, advantages=None, **knobs):
    old_t, rollout_t = torch.tensor(old), torch.tensor(rollout)
    mask = torch.ones_like(old_t) if mask is None else torch.tensor(mask)
    adv = None if advantages is None else torch.tensor(advantages)
    return rollout_corrections.get(name).fn(CorrectionInputs(old_t, rollout_t, mask, adv), **knobs)


def test_tis_geo_weighs_each_sequence_by_the_geometric_mean_of_its_ratios():
    ln2 = math.log(2)
    ln4 = 2 * ln2
    weights, _ = correction("tis-geo", [[ln2, -ln2, 0.0], [ln2, ln2, 50.0], [ln4, ln4, 0.0]], [[0.0] * 3] * 3,
                            mask=[[1, 1, 0], [1, 1, 0], [1, 1, 0]], tis_cap=3.0)  # fmt: skip
    # ρ = (2, ½): geometric mean 1 (product 1); (2, 2): 2 (product 4); (4, 4): 4, capped at 3; the padded
    # position changes none.
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 0.0]]))


def test_opsm_masks_negative_sequences_whose_rollout_drifted_from_theta_old():
    rollout = [[0.0, 0.0]] * 3
    old = [[-0.1, -0.1], [-0.1, -0.1], [-1e-4, -1e-4]]  # mean log π_rollout − log π_old: 0.1, 0.1, exactly δ
    weights, stats = correction("opsm", old, rollout, advantages=[[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]], opsm_delta=1e-4)
    assert weights.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # Â ≥ 0 kept; at δ kept (strict)
    assert stats["opsm_masked_frac"] == pytest.approx(1 / 3)


def test_kpop_keeps_a_token_while_the_binary_kl_both_ways_stays_under_the_threshold():
    old, rollout = [[math.log(0.5), math.log(0.3)]], [[math.log(0.25), math.log(0.3)]]
    # p = 0.5, q = 0.25: KL(p‖q) = 0.1438, KL(q‖p) = 0.1308.
    tight, _ = correction("kpop", old, rollout, kpop_threshold=0.1)
    between, _ = correction("kpop", old, rollout, kpop_threshold=0.135)  # over one way only: still masked
    loose, _ = correction("kpop", old, rollout, kpop_threshold=0.15)
    torch.testing.assert_close(tight, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(between, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(loose, torch.tensor([[2.0, 1.0]]))  # kept: weighted by π_old/π_rollout


@pytest.mark.parametrize("name", ["kpop", "icepop", "mis-token"])
def test_a_token_the_engine_gave_probability_zero_is_dropped(name):
    """Probability 0 under the engine (log-prob −inf) is no sample of it: the token is dropped (weight 0), not kept
    at the clamped ratio e^20, although the trainer's probability is as tiny (their binary KL is then ~0)."""
    weights, stats = correction(name, [[math.log(1e-9), math.log(0.5)]], [[-math.inf, math.log(0.5)]])
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0]]))
    assert stats["is_masked_frac"] == 0.5


# ---- Kimi-style regulariser ------------------------------------------------------------------------------
def test_kimi_is_the_squared_log_ratio_to_the_behaviour_policy_and_loads_no_reference():
    from types import SimpleNamespace

    from rlvr_lightning.training.objective import compose_objective

    values = {"policy_loss": {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2}},
              "loss_agg": "token-mean", "kl_estimator": "kimi", "kl_coef": 0.1}  # fmt: skip
    objective = compose_objective(values)
    assert not objective.needs_reference and compose_objective({**values, "kl_estimator": "k3"}).needs_reference
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = (old + torch.tensor([[0.0, 0.3, -0.2]])).requires_grad_()
    mb = SimpleNamespace(old_logp=old, ref_logp=None, loss_mask=torch.ones(1, 3))  # no reference log-probs at all
    norms = OptimizerStepNorms(num_seqs=1.0, num_tokens=3.0, num_groups=1.0, num_mixed_seqs=0.0, world_size=1, norm_const=3.0)
    stats = {}
    term = objective.kl_loss(mb, logp, norms, stats)
    # τ·mean_t (log π_θ − log π_old)², no ½: (0 + 0.09 + 0.04)/3 · 0.1; its gradient 2τℓ/3 per token.
    assert term.item() == pytest.approx(0.1 * 0.13 / 3)
    term.backward()
    torch.testing.assert_close(logp.grad, 2 * 0.1 * torch.tensor([[0.0, 0.3, -0.2]]) / 3)
    torch.testing.assert_close(stats["kl"], torch.tensor([[0.0, 0.09, 0.04]]))


def test_kpop_reads_the_binary_kl_of_a_tiny_probability_exactly():
    """The engine gave the token 1e-15, the trainer 0.07: D(p‖q) = 0.07·ln(0.07/1e-15) + 0.93·ln(0.93/1) = 2.16 > φ = 2,
    so the token is left out; a clamp of q at 1e-8 read 1.04 and kept it at the weight e^20."""
    p, q = 0.07, 1e-15
    exact = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert exact == pytest.approx(2.1641, abs=1e-4)
    from rlvr_lightning.tensor_math import binary_kl

    d = binary_kl(torch.tensor([math.log(p)], dtype=torch.float64), torch.tensor([math.log(q)], dtype=torch.float64))
    assert d.item() == pytest.approx(exact, rel=1e-9)
    weights, _ = correction("kpop", [[math.log(p), math.log(0.5)]], [[math.log(q), math.log(0.5)]], kpop_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0]]))


def test_the_binary_kl_is_zero_between_equal_policies_and_infinite_where_one_has_no_mass():
    from rlvr_lightning.tensor_math import binary_kl

    logp = torch.tensor([0.0, math.log(0.3), -math.inf, math.log(0.3)])
    logq = torch.tensor([0.0, math.log(0.3), -math.inf, -math.inf])
    d = binary_kl(logp, logq)
    assert d[:3].tolist() == [0.0, 0.0, 0.0] and d[3].item() == math.inf
    assert binary_kl(torch.tensor([0.0]), torch.tensor([math.log(0.5)])).item() == pytest.approx(math.log(2))
