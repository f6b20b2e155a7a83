"""`RewardFunctions` was a callback; a user's reward functions are now the model's `rewards.functions`
(`rewards.settings`, scored by `training.scoring`). A configuration that still lists it gets one line with the new
spelling."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from rlvr_lightning.errors import ConfigError


class RewardFunctions(Callback):
    def __init__(self, **options: object) -> None:
        """Refused: give the functions with `--model.init_args.rewards.functions`."""
        raise ConfigError(
            "trainer.callbacks: RewardFunctions is now the model's rewards section; remove it from trainer.callbacks "
            "and give the functions with --model.init_args.rewards.functions='[{function: module.name, weight: w}]'"
        )
