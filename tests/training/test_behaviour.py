"""Where the update's θ_old log-probs come from (`training.behaviour.behaviour_source`): the update's own forward
wherever that is exact, else the trainer's separate pass, the engine's log-probs for stale rollouts without a
correction, and a proximal-policy piece's approximation where one is chosen with a correction."""

from __future__ import annotations

import pytest

from rlvr_lightning.training.behaviour import behaviour_source


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
