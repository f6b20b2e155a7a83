"""THR and OAR were callbacks; they are now the model's `shapers` section (`rlvr_lightning.shapers`), built with the
training step. A configuration that still lists them in `trainer.callbacks` gets one line with the new spelling."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from rlvr_lightning.errors import ConfigError


def moved(old: str, key: str) -> ConfigError:
    return ConfigError(
        f"trainer.callbacks: {old} is now the model's shapers section; remove it from trainer.callbacks and set its "
        f"options with --model.init_args.shapers.{key}.<option> (e.g. --model.init_args.shapers.thr.p 0.2)"
    )


class THRAttribution(Callback):
    def __init__(self, **options: object) -> None:
        """Refused: set THR with `--model.init_args.shapers.thr.<option>`."""
        raise moved("THRAttribution", "thr")


class OARAttribution(Callback):
    def __init__(self, **options: object) -> None:
        """Refused: set OAR with `--model.init_args.shapers.oar.<option>`."""
        raise moved("OARAttribution", "oar")
