"""GMPO's and SAPO's losses against their formulas on hand-checkable tensors: GMPO's geometric mean
with its one-sided clip in log space, SAPO's soft gate; on policy both give GRPO's gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.pieces import policy_losses
from rlvr_lightning.pieces.kinds import TokenLossInputs
from tests.algos.test_grpo_family import off_policy_batch
from tests.support.pieces import aggregate


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
