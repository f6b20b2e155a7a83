"""The step's hooks (`rlvr_lightning.context`: `RolloutObserver`, `AdvantageShaper`) as Lightning callbacks, and
which of a trainer's callbacks have them: a callback given with `--trainer.callbacks` watches the scored rollout
(`RolloutCallback`), or reweights token advantages (THR and OAR: `AdvantageShaper` callbacks). The training step
itself only knows the plain hooks; `algos.wiring` hands it the trainer's callbacks that have them.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.context import AdvantageShaper, RolloutObserver


class RolloutCallback(RolloutObserver, Callback):
    """A Lightning callback that also sees each freshly generated, scored rollout batch."""


def rollout_callbacks(trainer: L.Trainer) -> list[RolloutObserver]:
    return [cb for cb in trainer.callbacks if isinstance(cb, RolloutObserver)]


def advantage_shapers(trainer: L.Trainer) -> list[AdvantageShaper]:
    return [cb for cb in trainer.callbacks if isinstance(cb, AdvantageShaper)]
