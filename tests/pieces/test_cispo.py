"""CISPO's loss against its formula: the gradient is REINFORCE's weighted by the clipped importance
ratio, no gradient flows through the weight, and no token is silenced (unlike PPO's clip)."""

from __future__ import annotations

import torch

from tests.algos.test_grpo_family import off_policy_batch
from tests.support.pieces import aggregate, surrogate

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
