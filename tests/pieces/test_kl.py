"""The KL penalty (docs/algorithms.md#kl-penalty) by hand: each estimator's value and its gradient with
respect to log π_θ, alone and inside the step's loss as `compose_objective` builds it (β·KL with the
policy term's aggregator). Every test name but the Kimi-style regulariser's (`-k kimi`) contains `kl`, so
`pytest -k kl` runs them.

Notation: r = log π_θ − log π_ref and δ = −r = log π_ref − log π_θ (the docs' δ). By hand:
k1 = r, ∂/∂log π_θ = 1;  k2 = ½r², ∂ = r;  k3 = e^δ − δ − 1, ∂ = 1 − e^δ (0 where the value clamp at 10 holds).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.pieces.kinds import OptimizerStepNorms
from rlvr_lightning.training.batch import LossBatch
from rlvr_lightning.training.objective import compose_objective
from tests.support.pieces import kl_penalty

LN2, LN4 = math.log(2), math.log(4)

# Two sequences of lengths 2 and 3 (sequence 0 has one padded slot). r = log π_θ − log π_ref per token,
# chosen so that e^δ is 2, ½, 1, 4 and e³ (k3 clamped to 10 there).
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
LOGP = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -4.0]], dtype=torch.float64)
R = torch.tensor([[-LN2, LN2, 0.0], [0.0, -LN4, -3.0]], dtype=torch.float64)
REF_PAD = -5.0  # the padded slot's reference log-prob: an estimate of ≈ 4 there, which the mask must drop
REF = LOGP - R
REF[0, 2] = REF_PAD

# By hand, per estimator: (value, ∂value/∂log π_θ) on the five real tokens (sequence 0, then sequence 1).
KL_BY_HAND = {
    "k1": ([-LN2, LN2, 0.0, -LN4, -3.0], [1.0, 1.0, 1.0, 1.0, 1.0]),
    "k2": ([LN2**2 / 2, LN2**2 / 2, 0.0, LN4**2 / 2, 4.5], [-LN2, LN2, 0.0, -LN4, -3.0]),
    # δ = ln 2, −ln 2, 0, ln 4, 3: e^δ − δ − 1 = 1 − ln 2, ln 2 − ½, 0, 3 − 2 ln 2, e³ − 4 ≈ 16.09 → clamped to 10.
    "k3": ([1 - LN2, LN2 - 0.5, 0.0, 3 - 2 * LN2, 10.0], [-1.0, 0.5, 0.0, -3.0, 0.0]),
}
REAL = MASK.bool()


def by_hand(estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The hand table laid out as [2, 3] tensors (0 in the padded slot)."""
    value, grad = (torch.zeros_like(MASK) for _ in range(2))
    value[REAL], grad[REAL] = (torch.tensor(x, dtype=torch.float64) for x in KL_BY_HAND[estimator])
    return value, grad


@pytest.mark.parametrize("estimator", list(KL_BY_HAND))
def test_kl_estimator_value_and_gradient_by_hand(estimator):
    logp = LOGP.clone().requires_grad_(True)
    kl = kl_penalty(logp, REF, estimator)
    kl.sum().backward()
    value, grad = by_hand(estimator)
    torch.testing.assert_close(kl.detach()[REAL], value[REAL], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad[REAL], grad[REAL], rtol=1e-12, atol=1e-12)


def test_kl_k3_clamps_extreme_log_ratios_to_a_finite_value_with_zero_gradient():
    """Far from the reference k3 is clamped to 10 with no gradient, on both sides; δ itself is clamped
    to ±20 before exp(), so even δ = 1000 gives a finite value and gradient (no inf·0 = NaN)."""
    logp = torch.tensor([-1000.0, 0.0, -3.0, -12.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -1000.0, 0.0, 0.0], dtype=torch.float64)  # δ = 1000, −1000, 3, 12
    kl = kl_penalty(logp, ref, "k3")
    kl.sum().backward()
    assert kl.detach().tolist() == [10.0, 10.0, 10.0, 10.0]
    assert logp.grad.tolist() == [0.0, 0.0, 0.0, 0.0]
    # Just inside the clamp (δ = 2: e² − 3 ≈ 4.39) the value and gradient are the formula's.
    logp = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(1, dtype=torch.float64), "k3")
    kl.backward()
    assert kl.item() == pytest.approx(math.exp(2) - 3, rel=1e-12)
    assert logp.grad.item() == pytest.approx(1 - math.exp(2), rel=1e-12)


# ---- inside the step's loss ---------------------------------------------------------------------
ADV = torch.tensor([[1.0, 1.0, 7.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)  # 7 in the padded slot: masked
BETA = 0.1
N_SEQS, N_TOKENS, NORM_CONST = 2.0, 5.0, 4.0
# Each real token's weight in the aggregate, by hand: seq-mean-token-mean 1/(N·L_n) with L = (2, 3);
# token-mean 1/T_S with T_S = 5; seq-mean-token-sum-norm 1/(N·C) with C = 4.
TOKEN_WEIGHT = {
    "seq-mean-token-mean": [[1 / 4, 1 / 4, 0.0], [1 / 6, 1 / 6, 1 / 6]],
    "token-mean": [[1 / 5, 1 / 5, 0.0], [1 / 5, 1 / 5, 1 / 5]],
    "seq-mean-token-sum-norm": [[1 / 8, 1 / 8, 0.0], [1 / 8, 1 / 8, 1 / 8]],
}


def step_loss(loss_agg: str, estimator: str, kl_coef: float, is_weight: torch.Tensor | None = None):
    """(loss, ∂loss/∂log π_θ, stats) of one micro-batch holding the whole step, on policy (θ_old = θ:
    PPO-clip's term is −Â per token, with gradient −Â), from the objective the module composes."""
    objective = compose_objective({
        "policy_loss": {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2}},
        "loss_agg": loss_agg, "kl_estimator": estimator, "kl_coef": kl_coef,
    })  # fmt: skip
    logp = LOGP.clone().requires_grad_(True)
    # `tensors` (the forward's inputs) is read only by the forward, which these tests do without.
    mb = LossBatch(tensors=None, advantages=ADV, old_logp=LOGP.clone(), ref_logp=REF if kl_coef > 0 else None,
                   loss_mask=MASK, is_weight=is_weight, correct=torch.tensor([1.0, 0.0]), group_size=2)  # fmt: skip
    norms = OptimizerStepNorms(N_SEQS, N_TOKENS, 1.0, 0.0, world_size=1, norm_const=NORM_CONST)
    loss, stats = objective.micro_batch_loss(mb, logp, norms)
    loss.backward()
    return loss.item(), logp.grad, stats


def loss_by_hand(loss_agg: str, estimator: str, beta: float) -> tuple[float, torch.Tensor]:
    """Σ over real tokens of weight·(−Â + β·k), and per token weight·(−Â + β·∂k)."""
    w = torch.tensor(TOKEN_WEIGHT[loss_agg], dtype=torch.float64)
    value, grad = by_hand(estimator)
    return (w * (-ADV + beta * value) * MASK).sum().item(), w * (-ADV + beta * grad) * MASK


@pytest.mark.parametrize("loss_agg", list(TOKEN_WEIGHT))
@pytest.mark.parametrize("estimator", list(KL_BY_HAND))
def test_kl_term_in_the_step_loss_is_beta_times_the_policy_terms_aggregate(loss_agg, estimator):
    loss, grad, stats = step_loss(loss_agg, estimator, BETA)
    expected_loss, expected_grad = loss_by_hand(loss_agg, estimator, BETA)
    assert loss == pytest.approx(expected_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert grad[0, 2] == 0  # the padded slot, where the estimate is ≈ 4 and Â = 7, gets no gradient
    # The logged `train/kl` is the estimator's per-token value.
    torch.testing.assert_close(stats["kl"][REAL], by_hand(estimator)[0][REAL], rtol=1e-12, atol=1e-12)
    # Not vacuous: the KL term moves the loss and the gradient away from the policy term's.
    policy_loss, policy_grad = loss_by_hand(loss_agg, estimator, 0.0)
    assert abs(expected_loss - policy_loss) > 1e-3 and (expected_grad - policy_grad).abs().max() > 1e-3


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_kl_term_is_not_reweighted_by_the_rollout_correction(loss_agg):
    """The rollout correction's weights multiply the policy term only (as in verl), never β·KL."""
    is_weight = torch.tensor([[0.5, 2.0, 3.0], [0.25, 1.0, 0.5]], dtype=torch.float64)
    loss, grad, _ = step_loss(loss_agg, "k3", BETA, is_weight)
    w = torch.tensor(TOKEN_WEIGHT[loss_agg], dtype=torch.float64)
    value, dk = by_hand("k3")
    assert loss == pytest.approx((w * (-ADV * is_weight + BETA * value) * MASK).sum().item(), rel=1e-12)
    torch.testing.assert_close(grad, w * (-ADV * is_weight + BETA * dk) * MASK, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_kl_coef_zero_means_no_kl_term(loss_agg):
    """kl_coef = 0: no estimator, no reference log-probs read, no `kl` statistic; the policy term alone."""
    objective = compose_objective({"policy_loss": {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2}},
                                   "loss_agg": loss_agg, "kl_estimator": "k3", "kl_coef": 0.0})  # fmt: skip
    assert objective.kl is None
    loss, grad, stats = step_loss(loss_agg, "k3", 0.0)  # ref_logp=None: reading it would fail
    expected_loss, expected_grad = loss_by_hand(loss_agg, "k3", 0.0)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert "kl" not in stats


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
