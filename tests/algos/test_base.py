"""`RLVRModule` (`algos.base`) on the tiny real model: the training step it builds from its settings."""

from __future__ import annotations

from rlvr_lightning.algos import GRPO
from rlvr_lightning.training.settings import ComputeSettings
from tests.support.settings import resettle
from tests.support.update_harness import attach


def test_a_built_step_is_rebuilt_with_the_settings_a_test_resettles(tiny_policy_dir):
    """The step is built once from the module's settings; `resettle` (a test's change of settings) must reach the
    next step, not leave the one built before it running (every layout would then run the first one's)."""
    module = attach(GRPO, tiny_policy_dir)
    before = module.rlvr_step
    assert before.layout.micro_batch_size == ComputeSettings().micro_batch_size
    resettle(module, micro_batch_size=3)
    assert module.rlvr_step is not before and module.rlvr_step.layout.micro_batch_size == 3
