"""GRPO math on the hand-checkable toy batch of docs/algorithms.md#worked-example.

One group, G = 4, c = (1,0,0,0), L = (2,4,4,6), on policy (logp = old_logp), β = 0; and the same batch
off policy against PPO's clipped surrogate computed by hand. Then the losses the field adopted lately against their
papers' formulas: dual-clip PPO, DPPO's trust-region masks, DRO, GMPO, SAPO and CISPO.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.pieces import policy_losses
from rlvr_lightning.pieces.advantages import group_advantage, group_reward_stats
from rlvr_lightning.pieces.kinds import TokenLossInputs
from tests.algos.test_grpo_family import off_policy_batch
from tests.support.pieces import SURROGATES, aggregate, kl_penalty, surrogate

G, LENGTHS = 4, (2, 4, 4, 6)
T = max(LENGTHS)


def toy_batch(seed: int = 0):
    torch.manual_seed(seed)
    mask = torch.zeros(G, T)
    for n, L in enumerate(LENGTHS):
        mask[n, :L] = 1
    logp = (-torch.rand(G, T) * mask).requires_grad_(True)  # padded positions hold 0
    return logp, mask


def grpo_loss(
    logp, old_logp, mask, r, mode="seq-mean-token-mean", use_std=True, C=None, eps=(0.2, 0.2), loss_name="ppo-clip"
):
    A = group_advantage(r, G, use_std=use_std)[:, None] * mask
    per_tok, stats = surrogate(loss_name, logp, old_logp, A, mask, *eps)
    return aggregate(per_tok, mask, mode, num_seqs=mask.shape[0], num_tokens=mask.sum().item(), norm_const=C), stats


def test_group_advantage_values():
    r = torch.tensor([1.0, 0, 0, 0])
    torch.testing.assert_close(group_advantage(r, G), torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    # ±1 rewards give the same standardised advantages (affine invariance).
    torch.testing.assert_close(group_advantage(2 * r - 1, G), torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantage(r, G, use_std=False), torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_all_equal_group_has_exactly_zero_advantage():
    r = torch.tensor([1.0, 1, 1, 1, 0.3, 0.3, 0.3, 0.3])
    A = group_advantage(r, G)
    assert torch.equal(A, torch.zeros(8))
    assert group_reward_stats(r, G)["frac_reward_zero_std"] == 1.0


def test_group_advantage_rejects_singleton_groups():
    with pytest.raises(ValueError, match="group_size"):
        group_advantage(torch.ones(3), 1)


GRPO_ROW = (-0.1875, 0.03125, 0.03125, 0.0208333)
TOY_TABLE = {  # docs/algorithms.md#worked-example: per-token ∂loss/∂logp of rollouts 1..4, and the loss value
    "grpo": dict(mode="seq-mean-token-mean", use_std=True, C=None, surrogate="ppo-clip", grad=GRPO_ROW, loss=0.0),
    "dapo": dict(mode="token-mean", use_std=True, C=None, surrogate="ppo-clip",
                 grad=(-0.09375, 0.03125, 0.03125, 0.03125), loss=0.25, eps=(0.2, 0.28)),
    "dr-grpo": dict(mode="seq-mean-token-sum-norm", use_std=False, C=8, surrogate="ppo-clip",
                    grad=(-0.0234375, 0.0078125, 0.0078125, 0.0078125), loss=0.0625),
    "gspo": dict(mode="seq-mean-token-mean", use_std=True, C=None, surrogate="gspo", grad=GRPO_ROW, loss=0.0,
                 eps=(3e-4, 4e-4)),
    "gspo-token": dict(mode="seq-mean-token-mean", use_std=True, C=None, surrogate="gspo-token", grad=GRPO_ROW,
                       loss=0.0, eps=(3e-4, 4e-4)),
}  # fmt: skip


# Std-scaled advantages are invariant to DAPO's ±1 reward; Dr. GRPO's are not (it uses 0/1).
SCALES = [(p, s) for p in TOY_TABLE for s in ("0/1", "±1") if s == "0/1" or TOY_TABLE[p]["use_std"]]


@pytest.mark.parametrize("preset,reward_scale", SCALES)
def test_per_token_gradients_on_toy_batch(preset, reward_scale):
    row = TOY_TABLE[preset]
    logp, mask = toy_batch()
    r = torch.tensor([1.0, 0, 0, 0])
    if reward_scale == "±1":
        r = 2 * r - 1
    loss, _ = grpo_loss(
        logp, logp.detach(), mask, r, row["mode"], row["use_std"], row["C"], row.get("eps", (0.2, 0.2)), row["surrogate"]
    )
    loss.backward()
    for n, L in enumerate(LENGTHS):
        torch.testing.assert_close(logp.grad[n, :L], torch.full((L,), row["grad"][n]), atol=1e-6, rtol=1e-5)
        assert torch.all(logp.grad[n, L:] == 0)
    # The surrogate's value on policy is −Σ mask·Â / normaliser (docs/algorithms.md#worked-example).
    assert loss.item() == pytest.approx(row["loss"], abs=1e-6)


# log π_θ − log π_old of each response token (L = 2, 4, 4, 6): ratios 0.67, 0.90, 1.05, 1.25, 1.35 lie below
# 1 − ε_low, inside the clip range, between 1 + ε_high = 1.2 (symmetric) and 1.28 (clip-higher), and above it.
LOG_1_25 = math.log(1.25)
OFF_POLICY_LOG_RATIOS = (
    (0.3, -0.1),
    (LOG_1_25, -0.4, 0.05, -0.1),
    (-0.4, 0.3, LOG_1_25, 0.05),
    (-0.1, -0.4, 0.3, 0.05, LOG_1_25, 0.0),
)


def clipped_surrogate_by_hand(logp, old_logp, mask, A, eps_low, eps_high):
    """PPO's per-token term and its derivative d/d log π_θ, one token at a time in Python floats:
    ℓ = −min(ρÂ, clip(ρ, 1−ε_low, 1+ε_high)Â); ∂ℓ/∂log π_θ = −ρÂ where the min takes the unclipped branch
    (Â > 0 and ρ < 1+ε_high, or Â < 0 and ρ > 1−ε_low), else 0."""
    value, grad = torch.zeros(mask.shape, dtype=torch.float64), torch.zeros(mask.shape, dtype=torch.float64)
    for n, t in mask.nonzero().tolist():
        rho, a = math.exp(logp[n, t].item() - old_logp[n, t].item()), A[n]
        value[n, t] = -min(rho * a, min(max(rho, 1 - eps_low), 1 + eps_high) * a)
        grad[n, t] = -rho * a if (a > 0 and rho < 1 + eps_high) or (a < 0 and rho > 1 - eps_low) else 0.0
    return value, grad


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr-grpo"])
def test_off_policy_loss_and_gradient_follow_the_clipped_surrogate_and_the_normaliser(preset):
    """Independent θ_old (ratios on both sides of the clip range, both advantage signs): the loss and
    ∂loss/∂logp equal PPO's clipped surrogate computed by hand, over each algorithm's normaliser
    (GRPO N·L_n, DAPO ΣL, Dr. GRPO N·C; docs/algorithms.md#loss-aggregation)."""
    row = TOY_TABLE[preset]
    eps_low, eps_high = row.get("eps", (0.2, 0.2))
    logp, mask = toy_batch()
    shift = torch.zeros(G, T)
    for n, row_shift in enumerate(OFF_POLICY_LOG_RATIOS):
        shift[n, : len(row_shift)] = torch.tensor(row_shift)
    old_logp = (logp.detach() - shift) * mask
    r = torch.tensor([1.0, 1, 0, 0])  # two positives: one sees the symmetric and clip-higher bounds differ
    loss, stats = grpo_loss(logp, old_logp, mask, r, row["mode"], row["use_std"], row["C"], (eps_low, eps_high))
    loss.backward()
    a = 0.5 / math.sqrt(1 / 3) if row["use_std"] else 0.5  # mean 1/2, unbiased std √(1/3)
    A = [a, a, -a, -a]
    value, grad = clipped_surrogate_by_hand(logp, old_logp, mask, A, eps_low, eps_high)
    L = mask.sum(1, keepdim=True).double()
    normaliser = {"grpo": G * L, "dapo": L.sum(), "dr-grpo": torch.tensor(G * 8.0)}[preset]
    assert loss.item() == pytest.approx((value / normaliser).sum().item(), rel=1e-5)
    torch.testing.assert_close(logp.grad.double(), grad / normaliser * mask, rtol=1e-5, atol=1e-7)
    # Not vacuous: tokens silenced by the clip (zero gradient) and tokens that pass it, for both signs of Â.
    for sign in (1, -1):
        rows = [n for n in range(G) if A[n] * sign > 0]
        assert (grad[rows] == 0).logical_and(mask[rows].bool()).any() and (grad[rows] != 0).any()
    assert (stats["clipped_low"] | stats["clipped_high"]).any()


@pytest.mark.parametrize("loss_name", SURROGATES)
def test_on_policy_ratio_is_one_and_nothing_is_clipped_or_gated(loss_name):
    """On policy every token keeps the plain policy gradient: ∂(Σ_t ℓ_t)/∂log π_θ = −Â on every token.
    A clip that fired would zero it (PPO, GSPO, GMPO) or bound its weight (CISPO); SAPO, whose clip
    masks are always false, must have its soft gate's slope 4σ(1−σ)·r equal to 1 at r = 1, for both
    temperatures (τ_pos for Â > 0, τ_neg for Â < 0)."""
    logp, mask = toy_batch()
    A = group_advantage(torch.tensor([1.0, 0, 0, 0]), G)[:, None] * mask  # both signs of Â
    # Even GSPO's tiny 3e-4 clip range must not fire on policy.
    per_tok, stats = surrogate(loss_name, logp, logp.detach(), A, mask, 3e-4, 4e-4)
    (per_tok * mask).sum().backward()
    torch.testing.assert_close(logp.grad, -A, rtol=1e-6, atol=1e-7)
    assert ((stats["ratio"] - 1).abs() * mask).max() < 1e-6
    assert not stats["clipped_low"].any() and not stats["clipped_high"].any()


@pytest.mark.parametrize("preset", list(TOY_TABLE))
@pytest.mark.parametrize("rewards", [(0.0, 0, 0, 0), (1.0, 1, 1, 1), (-0.5, -0.5, -0.5, -0.5)])
def test_zero_signal_groups_give_exactly_zero_gradient(preset, rewards):
    row = TOY_TABLE[preset]
    logp, mask = toy_batch()
    old = logp.detach() - 0.1 * mask  # off policy too: zero advantage must still mean zero gradient
    loss, _ = grpo_loss(logp, old, mask, torch.tensor(rewards), row["mode"], row["use_std"], row["C"],
                        row.get("eps", (0.2, 0.2)), row["surrogate"])  # fmt: skip
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_ppo_clip_asymmetric_branches():
    logp = torch.log(torch.tensor([[0.5, 1.5, 1.1, 0.9]]))
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    pos, stats = surrogate("ppo-clip", logp, old, torch.ones(1, 4), mask, eps_low=0.2, eps_high=0.28)
    neg, stats_neg = surrogate("ppo-clip", logp, old, -torch.ones(1, 4), mask, eps_low=0.2, eps_high=0.28)
    # Â > 0: ratio capped at 1+ε_high from above; below 1−ε_low the unclipped ratio is the min.
    torch.testing.assert_close(pos, -torch.tensor([[0.5, 1.28, 1.1, 0.9]]))
    assert stats["clipped_high"].tolist() == [[False, True, False, False]]
    # Â < 0: ratio floored at 1−ε_low; above 1+ε_high the unclipped ratio is kept (pessimistic bound).
    torch.testing.assert_close(neg, torch.tensor([[0.8, 1.5, 1.1, 0.9]]))
    assert stats_neg["clipped_low"].tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_zero_value_and_gradient_at_reference(estimator):
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    kl = kl_penalty(logp, logp.detach(), estimator)
    assert torch.equal(kl.detach(), torch.zeros(3))
    if estimator != "k1":  # k1's gradient is 1 everywhere; its expectation is what vanishes
        kl.sum().backward()
        assert torch.allclose(logp.grad, torch.zeros(3))


def test_k3_is_nonnegative_and_clamped():
    logp = torch.linspace(-30, 0, 50)
    ref = torch.linspace(0, -30, 50)
    kl = kl_penalty(logp, ref, "k3")
    assert (kl >= 0).all() and (kl <= 10).all()


@pytest.mark.parametrize(
    "mode,C", [("seq-mean-token-mean", None), ("token-mean", None), ("seq-mean-token-sum-norm", 8)]
)
def test_micro_batch_and_rank_layout_does_not_change_the_gradient(mode, C):
    torch.manual_seed(1)
    N = 8
    lengths = torch.tensor([2, 4, 4, 6, 1, 3, 6, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(N, T) * mask
    logp = (old + 0.1 * torch.randn(N, T) * mask).requires_grad_(True)
    A = group_advantage(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1]), G)[:, None] * mask
    N_S, T_S = float(N), mask.sum().item()

    def grad_for(splits: list[list[int]], world_size: int = 1) -> torch.Tensor:
        logp.grad = None
        for idx in splits:
            per_tok, _ = surrogate("ppo-clip", logp[idx], old[idx], A[idx], mask[idx], 0.2, 0.28)
            # Simulated ranks: each rank's gradient is averaged over ranks afterwards (DDP/FSDP).
            (aggregate(per_tok, mask[idx], mode, N_S, T_S, C, world_size) / world_size).backward()
        return logp.grad.clone()

    one_pass = grad_for([list(range(N))])
    torch.testing.assert_close(grad_for([[0, 1, 2], [3, 4], [5, 6, 7]]), one_pass, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_for([[0, 1, 2, 3], [4, 5, 6, 7]], world_size=2), one_pass, rtol=1e-5, atol=1e-7)


def test_padding_changes_neither_loss_nor_gradient():
    logp, mask = toy_batch()
    r = torch.tensor([1.0, 0, 0, 0])
    loss, _ = grpo_loss(logp, logp.detach() - 0.05 * mask, mask, r)
    loss.backward()
    grad = logp.grad.clone()
    wide = torch.cat([logp.detach(), torch.zeros(G, 5)], 1).requires_grad_(True)
    wide_mask = torch.cat([mask, torch.zeros(G, 5)], 1)
    loss2, _ = grpo_loss(wide, wide.detach() - 0.05 * wide_mask, wide_mask, r)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-7)
    torch.testing.assert_close(wide.grad[:, :T], grad)
    assert torch.equal(wide.grad[:, T:], torch.zeros(G, 5))


def test_unknown_aggregator_is_a_clear_error():
    with pytest.raises(ValueError, match="registered: seq-mean-token-mean"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "bnpo", 1, 1)


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


# ---- GMPO and SAPO -----------------------------------------------------------------------------------------------
def seq_mean_grad(name: str, logp, old, adv, mask, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, ∂loss/∂logp) of the policy loss `name` reduced by seq-mean-token-mean."""
    logp.grad = None
    per_tok, _ = policy_losses.get(name).fn(TokenLossInputs(logp, old, adv, mask), **knobs)
    loss = aggregate(per_tok, mask, "seq-mean-token-mean", mask.shape[0], mask.sum().item())
    loss.backward()
    return loss.detach(), logp.grad.clone()


def test_gmpo_by_hand():
    # Sequence 0: Â = 2, log-ratios (0.1, 0.6): 0.6 is clipped to ε_high = 0.4 (no gradient).
    # Sequence 1: Â = −1, log-ratios (−0.7, 0.5): −0.7 is clipped to −ε_low = −0.4; 0.5 is not (Â < 0).
    old = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]])
    logp = (old + torch.tensor([[0.1, 0.6], [-0.7, 0.5]])).requires_grad_(True)
    adv, mask = torch.tensor([[2.0, 2.0], [-1.0, -1.0]]), torch.ones(2, 2)
    loss, grad = seq_mean_grad("gmpo", logp, old, adv, mask, clip_eps_low=0.4, clip_eps_high=0.4)
    j0, j1 = 2 * math.exp((0.1 + 0.4) / 2), -1 * math.exp((-0.4 + 0.5) / 2)
    assert loss.item() == pytest.approx(-(j0 + j1) / 2)
    # ∂(−J_i/N)/∂ℓ_t = −Â_i·exp(mean)·(1/L_i)/N for unclipped tokens.
    torch.testing.assert_close(grad, torch.tensor([[-j0 / 4, 0.0], [0.0, -j1 / 4]]))


@pytest.mark.parametrize("name,knobs", [("gmpo", {"clip_eps_low": 0.4, "clip_eps_high": 0.4}), ("sapo", {})])
def test_on_policy_the_gradient_is_grpos(name, knobs):
    logp, _, mask = off_policy_batch(seed=6)
    adv = torch.randn(mask.shape[0], 1, generator=torch.Generator().manual_seed(0)).expand_as(mask) * mask
    _, grad = seq_mean_grad(name, logp, logp.detach(), adv, mask, **knobs)
    _, grpo = seq_mean_grad("ppo-clip", logp, logp.detach(), adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(grad, grpo)


def test_sapo_gradient_is_the_soft_gate_derivative_with_the_temperature_of_the_advantages_sign():
    logp, old, mask = off_policy_batch(seed=7, spread=0.5)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    _, grad = seq_mean_grad("sapo", logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    r = (logp.detach() - old).exp()
    tau = torch.where(adv > 0, 1.0, 2.0)
    s = torch.sigmoid(tau * (r - 1))
    # d/dlogp of −(4/τ)σ(τ(r−1))·Â = −4σ(1−σ)·r·Â, then seq-mean-token-mean: / (N·L_n).
    per_seq = mask.shape[0] * mask.sum(1, keepdim=True)
    torch.testing.assert_close(grad, -4 * s * (1 - s) * r * adv * mask / per_seq)
    far = (r - 1).abs() > 0.5  # the gate fades off policy instead of cutting to 0 at a clip edge
    assert (grad[far & mask.bool() & (adv != 0)] != 0).all()


# ---- CISPO ------------------------------------------------------------------------------------------------------
EPS_LOW, EPS_HIGH = 0.2, 0.28


def token_mean_grad(name: str, logp, old, adv, mask) -> torch.Tensor:
    logp.grad = None
    per_tok, _ = surrogate(name, logp, old, adv, mask, EPS_LOW, EPS_HIGH)
    aggregate(per_tok, mask, "token-mean", mask.shape[0], mask.sum().item()).backward()
    return logp.grad.clone()


def test_the_gradient_is_the_clipped_weight_times_the_advantage_on_every_token():
    logp, old, mask = off_policy_batch(seed=3, spread=0.4)  # ratios well outside [0.8, 1.28]
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    ratio = (logp.detach() - old).exp()
    weight = ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH)
    # ∂/∂logp of −(1/T_S) Σ sg[w]·Â·logp: no term from the weight, which is a constant.
    expected = -weight * adv * mask / mask.sum()
    torch.testing.assert_close(token_mean_grad("cispo", logp, old, adv, mask), expected)
    outside = ((ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH)) & mask.bool() & (adv != 0)
    assert outside.sum() >= 5 and (expected[outside] != 0).all()  # clipped tokens keep their gradient


def test_inside_the_band_the_gradient_is_ppos_and_outside_ppo_silences_tokens_cispo_keeps():
    logp, old, mask = off_policy_batch(seed=4, spread=0.4)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    ratio = (logp.detach() - old).exp()
    inside = (ratio > 1 - EPS_LOW) & (ratio < 1 + EPS_HIGH) & mask.bool()
    cispo, ppo = token_mean_grad("cispo", logp, old, adv, mask), token_mean_grad("ppo-clip", logp, old, adv, mask)
    torch.testing.assert_close(cispo[inside], ppo[inside])
    silenced = mask.bool() & ~inside & (ppo == 0) & (adv != 0)
    assert silenced.any() and (cispo[silenced] != 0).all()


def test_on_policy_it_is_reinforce_with_the_token_mean():
    logp, _, mask = off_policy_batch(seed=5)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    grad = token_mean_grad("cispo", logp, logp.detach(), adv, mask)
    torch.testing.assert_close(grad, -adv * mask / mask.sum())
