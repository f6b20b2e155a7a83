"""Decoupled PPO's proximal policies (docs/algorithms.md#decoupled-ppo-and-the-proximal-policy): A-3PO's
log-linear interpolation on hand-checkable tensors, its invariants, where it is refused, and, in the
module's update, that it equals the recomputed θ_old where the two must agree."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.kinds import ProximalInputs
from rlvr_lightning.pieces.proximal import loglinear
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.training.settings import BehaviourSettings, OptimSettings


def inputs(behaviour, current, versions, v_prox, v_theta):
    b = torch.tensor([behaviour])
    return ProximalInputs(b, torch.tensor([current]), torch.tensor([versions]), v_prox, v_theta, torch.ones_like(b))


def test_loglinear_interpolates_by_each_tokens_version():
    # α = (4 − 3)/(6 − 3) = 1/3 and (4 − 2)/(6 − 2) = 1/2: −1 + (−0.5 + 1)/3, −2 + (−1 + 2)/2.
    out = loglinear(inputs([-1.0, -2.0], [-0.5, -1.0], [3, 2], v_prox=4, v_theta=6))
    torch.testing.assert_close(out, torch.tensor([[-1.0 + 0.5 / 3, -1.5]]))


def test_loglinear_is_the_current_policy_at_the_first_step_and_the_behaviour_for_on_policy_tokens():
    g = torch.Generator().manual_seed(0)
    behaviour, current = -torch.rand(2, 5, generator=g) * 3, -torch.rand(2, 5, generator=g) * 3
    versions = torch.tensor([[1, 1, 2, 3, 3], [3, 2, 2, 1, 3]])
    mask = torch.ones(2, 5)
    first = loglinear(ProximalInputs(behaviour, current, versions, 3, 3, mask))
    torch.testing.assert_close(first, current)  # v_θ = v_prox: α = 1 everywhere, θ_old exactly
    later = loglinear(ProximalInputs(behaviour, current, versions, 3, 5, mask))
    on_policy = versions == 3
    torch.testing.assert_close(later[on_policy], behaviour[on_policy])  # α = 0: sampled by θ_old itself
    low, high = torch.minimum(behaviour, current), torch.maximum(behaviour, current)
    assert bool(((later >= low - 1e-6) & (later <= high + 1e-6)).all())  # α ∈ [0, 1]: between the two


def test_loglinear_needs_a_rollout_correction_and_a_loss_that_reads_no_step_first():
    from rlvr_lightning.algos import GRPO, REAL

    with pytest.raises(ConfigError, match="set model.rollout_correction"):
        GRPO(proximal_policy="loglinear")
    with pytest.raises(ConfigError, match="keep model.behaviour.logprobs=trainer"):
        GRPO(proximal_policy="loglinear", rollout_correction="tis-token", behaviour=BehaviourSettings(logprobs="rollout"))
    with pytest.raises(ConfigError, match="use model.proximal_policy=recompute"):
        GRPO(proximal_policy="loglinear", rollout_correction="tis-token", policy_loss="clip-cov")
    with pytest.raises(ConfigError):
        REAL(proximal_policy="loglinear", rollout_correction="tis-token")
    GRPO(proximal_policy="loglinear", rollout_correction="tis-token")


def test_with_one_step_per_batch_loglinear_trains_as_the_recomputed_theta_old(lagged_module):
    """One optimizer step per rollout batch: the update runs at θ_old, so A-3PO's π_prox (α = 1) is the update
    forward's own log-probs, and the step (loss, TIS weights, gradient norm) is the recomputed θ_old's, up to
    the rounding of two forwards laid out differently; the first batch ahead is stale (version 0 at 1)."""
    runs = {}
    for proximal in ("recompute", "loglinear"):  # every group mixed, and steps large enough to move the weights
        module = lagged_module(max_staleness=1, rollout_correction={"name": "tis-token", "knobs": {"tis_cap": 1.001}},
                               proximal_policy=proximal, rewards=RewardSettings(correctness="tests.support.rewards.alternating"),
                               optim=OptimSettings(lr=1e-2))  # fmt: skip
        batches = iter(module.trainer.datamodule.train_dataloader())
        steps = []
        for _ in range(2):
            steps.append(module.train_on_batch(next(batches)))
            module.rollout_batches += 1
        runs[proximal] = (module.rlvr_step.resolved.behaviour, steps)
    assert runs["recompute"][0] == "trainer" and runs["loglinear"][0] == "proximal"
    assert runs["loglinear"][1][1].metrics["tis_capped_frac"] > 0  # the stale batch: sampled by version 0
    for a, b in zip(runs["recompute"][1], runs["loglinear"][1], strict=True):
        assert b.metrics["grad_norm"] > 0  # the weights act on a gradient
        for key in ("loss", "grad_norm", "tis_weight_mean", "tis_capped_frac", "staleness_max"):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key
        torch.testing.assert_close(b.inputs.behaviour.old_logp_all(), a.inputs.behaviour.old_logp_all(), atol=1e-5, rtol=0)
