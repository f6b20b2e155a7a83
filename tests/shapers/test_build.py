"""Building a `shapers` section (`shapers.build`): THR, OAR and the user's shapers in order, each with its settings; a
user's shaper that cannot be built is one error line; a user's shaper's weights reach the loss."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.context import AdvantageShaper
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.shapers.build import build_shapers
from rlvr_lightning.shapers.settings import ShaperSettings


class Scaled(AdvantageShaper):
    """A user's shaper with a knob of its own: every token of the rollout batch weighs `scale`."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def token_weights(self, step, batch) -> torch.Tensor:
        rollout = batch.rollout
        return torch.full((rollout.num_sequences, int(rollout.response_lengths.max())), self.scale)


def built(**section) -> tuple:
    return build_shapers(ShaperSettings.of(section))


def test_the_sections_shapers_are_built_in_order_each_with_its_settings():
    thr, oar, scaled = built(oar={"method": "perturbation"}, thr={"p": -0.2},
                             custom=[{"name": f"{__name__}.Scaled", "knobs": {"scale": 2.0}}])  # fmt: skip
    assert (type(thr).__name__, thr.settings.p) == ("THRShaper", -0.2)
    assert (type(oar).__name__, oar.settings.method, oar.settings.readout_used) == ("OARShaper", "perturbation", "last")
    assert isinstance(scaled, Scaled) and scaled.scale == 2.0
    assert built() == ()


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ({"name": f"{__name__}.Scaled", "knobs": {"scael": 2.0}}, r"Scaled\S*: knobs \['scael'\] do not fit Scaled\(scale"),
        ({"name": "rlvr_lightning.errors.ConfigError"}, r"ConfigError is not a subclass of \S+AdvantageShaper$"),
        ({"name": "no_such_module.Shaper"}, r"cannot import 'no_such_module.Shaper'"),
    ],
    ids=["unknown-knob", "not-a-shaper", "not-importable"],
)
def test_a_users_shaper_that_cannot_be_built_is_one_error_line(custom, message):
    with pytest.raises(ConfigError, match=r"^model.shapers.custom=.*" + message):
        built(custom=[custom])


def test_a_users_shaper_weighs_the_tokens_the_loss_receives(tiny_policy_dir):
    from rlvr_lightning.algos import GRPO
    from tests.support.update_harness import attach, sample_rollout

    module = attach(GRPO, tiny_policy_dir, shapers={"custom": [{"name": f"{__name__}.Scaled", "knobs": {"scale": 3.0}}]})
    _, inputs, _ = module.rlvr_step.prepare(module.step_context(), sample_rollout(module))
    weights, response = inputs.token_weights(), inputs.tensors.response_mask.bool()
    assert response.any() and (weights[response] == 3.0).all()
