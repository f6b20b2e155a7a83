"""Building the training step from plain values (`training.step_setup`): the run's checks where asked, the layout
from the `rollout:` settings, and a step that owns its streak of non-finite updates."""

from __future__ import annotations

import pytest

from rlvr_lightning.context import AdvantageShaper
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.training.engine_session import EngineSession
from rlvr_lightning.training.settings import StepSettings
from rlvr_lightning.training.step import StepAlgorithm
from rlvr_lightning.training.step_setup import build_training_step

ROLLOUT = RolloutSettings(group_size=4, max_response_length=24, engine="hf")


def settings(**args) -> StepSettings:
    return StepSettings.of_config({"class_path": "rlvr_lightning.algos.GRPO", "init_args": args})


def build(step_settings, environment=None, check=True, batch_size=4, sharded_ranks=False):
    return build_training_step(step_settings, StepAlgorithm(), ROLLOUT, batch_size, EngineSession(),
                               environment=environment, sharded_ranks=sharded_ranks, check=check)  # fmt: skip


class WeighsInserted(AdvantageShaper):
    """A shaper that would weigh an environment's inserted tokens too."""


INSERTED = {"custom": [{"name": f"{__name__}.WeighsInserted"}]}


def test_the_step_has_its_settings_layout_and_a_streak_of_its_own():
    step = build(settings(loss_agg="seq-mean-token-sum-norm", compute={"max_nonfinite_steps": 3}))
    assert step.layout.norm_const == ROLLOUT.max_response_length  # C of seq-mean-token-sum-norm: the run's L_max
    assert step.pieces.objective.policy_loss.name == "ppo-clip" and step.rollout_settings is ROLLOUT
    assert step.nonfinite.max_streak == 3 and build(settings()).nonfinite is not step.nonfinite


def test_in_an_environment_a_shaper_that_weighs_inserted_tokens_is_refused_when_checked():
    with pytest.raises(ConfigError, match=r"^data.tool with model.shapers.custom=\S+WeighsInserted: it does not leave"):
        build(settings(shapers=INSERTED), environment="data.tool")
    build(settings(shapers={"thr": {"p": 0.2}, "oar": {}}), environment="data.tool")  # they weigh sampled tokens only
    build(settings(shapers=INSERTED))  # no environment: nothing is inserted
    build(settings(shapers=INSERTED), environment="data.tool", check=False)  # built unchecked outside a run


def test_a_shaper_whose_forwards_differ_between_ranks_is_refused_on_a_sharded_policy():
    with pytest.raises(ConfigError, match=r"^model.shapers.oar does not support a policy sharded over several ranks"):
        build(settings(shapers={"oar": {}}), sharded_ranks=True)
    build(settings(shapers={"thr": {"p": 0.2}}), sharded_ranks=True)  # THR's forwards are the update's own
    build(settings(shapers={"oar": {}}))  # one rank, or DDP


def test_the_runs_checks_run_when_asked():
    with pytest.raises(ConfigError, match=r"^data.batch_size=3 prompts must divide into model.num_mini_batches=2"):
        build(settings(num_mini_batches=2), batch_size=3)
    build(settings(num_mini_batches=2), batch_size=3, check=False)
