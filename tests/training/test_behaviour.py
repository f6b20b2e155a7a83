"""Where the update's θ_old log-probs come from (`training.behaviour.behaviour_source`): the update's own forward
wherever that is exact, else the trainer's separate pass, the engine's log-probs for stale rollouts without a
correction, and a proximal-policy piece's approximation where one is chosen with a correction. On the tiny real model: θ_old from the update's forward gives
the update a separate pass gives."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.training.behaviour import FromUpdateForward, behaviour_source
from rlvr_lightning.training.settings import ComputeSettings
from tests.support.update_harness import (
    PRESETS,
    attach,
    gradient,
    prepared,
    sample_rollout,
    trainer_old_logp,
    with_old_logp,
)


@pytest.mark.parametrize(
    ("kwargs", "source"),
    [({}, "update"),  # one optimizer step, on policy: the update's first forward is θ_old
     ({"optimizer_steps_per_batch": 2}, "trainer"),  # the second step's forward is no longer θ_old
     ({"corrected": True}, "trainer"),  # a correction needs θ_old's weights before the update
     ({"reads_step_first": True}, "trainer"),  # two-pass, or a token selection over the step
     ({"behaviour_logprobs": "rollout"}, "rollout"),  # asked for
     ({"stale": True}, "rollout"),  # versions behind: the trainer's weights are not the behaviour policy
     ({"stale": True, "corrected": True}, "trainer"),  # decoupled PPO: the trainer's θ_old against the engine's
     ({"corrected": True, "approximates_proximal": True}, "proximal"),
     ({"approximates_proximal": True}, "update")],  # without a correction there is nothing to approximate for
)  # fmt: skip
def test_theta_old_comes_from_the_update_wherever_that_is_exact(kwargs, source):
    args = {"behaviour_logprobs": "trainer", "optimizer_steps_per_batch": 1, "corrected": False,
            "reads_step_first": False} | kwargs  # fmt: skip
    assert behaviour_source(**args) == source


@pytest.mark.parametrize("preset", list(PRESETS))
def test_old_logprobs_from_the_update_forward_equal_a_separate_pass(tiny_policy_dir, preset):
    """With one update per rollout batch the separate θ_old pass is skipped (behaviour source `update`):
    same loss and gradient as with θ_old's log-probs from their own no-grad forward, and the log-probs
    the update recorded are exactly those."""
    cls, kwargs = PRESETS[preset]
    module = attach(cls, tiny_policy_dir, compute=ComputeSettings(micro_batch_size=3), **kwargs)
    if module.rlvr_step.resolved.behaviour != "update":
        pytest.skip("this preset's θ_old does not come from the update's forward")
    inputs = prepared(module, sample_rollout(module))
    assert isinstance(inputs.behaviour, FromUpdateForward)  # the separate pass did not run
    explicit = with_old_logp(inputs, trainer_old_logp(module, inputs, 3))  # same micro-batches: same numerics
    loss_a, g_a = gradient(module, inputs, 3)
    loss_b, g_b = gradient(module, explicit, 3)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(
        inputs.behaviour.old_logp_all(), explicit.behaviour.old_logp_all(), rtol=0, atol=1e-6
    )
