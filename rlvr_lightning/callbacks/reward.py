"""The reward verifier was a callback; it is now the model's `rewards` section, scored by the module's own stage
(`training.scoring`). A configuration that still lists it gets one line with the new spelling."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from rlvr_lightning.errors import ConfigError


class RewardVerifier(Callback):
    def __init__(self, **options: object) -> None:
        """Refused: set math-verify's options with `--model.init_args.rewards.verifier.<option>`."""
        raise ConfigError(
            "trainer.callbacks: RewardVerifier is now the model's rewards section; remove it from trainer.callbacks and "
            "set its options with --model.init_args.rewards.verifier.<option> (e.g. .multiple_boxed last)"
        )
