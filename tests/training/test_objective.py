"""The update's loss composed from its pieces (`training.objective`), on hand-checkable tensors: the clipped policy
term aggregated over the optimizer step's tokens, the rollout correction's weights on the policy term only, and
β·KL to the reference with the same aggregator; no KL term and no reference policy when β = 0."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.pieces.kinds import OptimizerStepNorms
from rlvr_lightning.training.batch import LossBatch
from rlvr_lightning.training.objective import compose_objective
from tests.support.update_harness import attach, gradient, prepared, sample_rollout, set_engine_logprobs

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5 tokens
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
NORMS = OptimizerStepNorms(num_seqs=2, num_tokens=5, num_groups=1, num_mixed_seqs=2, world_size=1, norm_const=3)


def objective(kl_coef: float = 0.0):
    values = {"policy_loss": {"name": "ppo-clip", "knobs": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": None}},
              "loss_agg": "token-mean", "kl_estimator": "k3", "kl_coef": kl_coef}  # fmt: skip
    return compose_objective(values)


def batch(ref=None, is_weight=None) -> LossBatch:
    return LossBatch(None, ADV, OLD, ref, MASK, is_weight, torch.tensor([1.0, 0.0]), 2)


def test_on_policy_the_loss_is_minus_the_token_mean_advantage_and_beta_zero_has_no_reference():
    plain = objective()
    assert plain.kl is None and not plain.needs_reference
    loss, stats = plain.micro_batch_loss(batch(), OLD.clone(), NORMS)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5)  # ratio 1: −Σ A / T_S
    assert stats["ratio"][MASK.bool()].tolist() == pytest.approx([1.0] * 5)


def test_the_ratio_is_clipped_where_it_would_gain_beyond_the_range():
    logp = OLD + torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])  # ratios 1.5 and 0.5
    loss, _ = objective().micro_batch_loss(batch(), logp, NORMS)
    # per token max(−A·r, −A·clip(r)): A = 1 at r = 1.5 gives −1.2; A = −2 at r = 0.5 gives 2·0.8 = 1.6
    expected = -(1.2 * 1 + 1 + 1) - (-2 * 0.8 + -2 * 1)
    assert loss.item() == pytest.approx(expected / 5)


def test_the_correction_weighs_the_policy_term_and_the_kl_term_is_beta_times_its_token_mean():
    weights = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    loss, _ = objective().micro_batch_loss(batch(is_weight=weights), OLD.clone(), NORMS)
    assert loss.item() == pytest.approx(-(2 + 1 + 1 - 2 - 1) / 5)
    ref = OLD + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 5.0]])  # the padded token's gap must not count
    with_kl = objective(kl_coef=0.5)
    assert with_kl.needs_reference
    loss, stats = with_kl.micro_batch_loss(batch(ref=ref), OLD.clone(), NORMS)
    gap = (ref - OLD)[MASK.bool()]
    k3 = (gap.exp() - gap - 1).sum() / 5  # k3 = e^{ref − θ} − (ref − θ) − 1, token mean
    assert loss.item() == pytest.approx(-(3 - 4) / 5 + 0.5 * k3.item(), rel=1e-6)
    assert "kl" in stats


def test_truncated_is_scales_the_policy_gradient_by_the_capped_ratio(tiny_policy_dir):
    plain = attach(GRPO, tiny_policy_dir)
    rollout = sample_rollout(plain)
    inputs = prepared(plain, rollout)
    _, g_plain = gradient(plain, inputs, 8)
    # The engine assigned every token 1/1.5 of the trainer's probability: w = 1.5 (under the cap of 2).
    set_engine_logprobs(rollout, inputs.behaviour.old_logp_all() - torch.log(torch.tensor(1.5)))
    tis = attach(GRPO, tiny_policy_dir, rollout_correction={"name": "tis-token", "knobs": {"tis_cap": 2.0}})
    tis.policy.load_state_dict(plain.policy.state_dict())
    tis_inputs = prepared(tis, rollout)
    torch.testing.assert_close(tis_inputs.is_weight, 1.5 * tis_inputs.loss_mask)
    _, g_tis = gradient(tis, tis_inputs, 8)
    torch.testing.assert_close(g_tis, 1.5 * g_plain, rtol=1e-4, atol=1e-7)
