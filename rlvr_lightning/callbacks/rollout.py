"""The step's observer hook (`rlvr_lightning.context.RolloutObserver`) as a Lightning callback, and which of a
trainer's callbacks have it: a callback given with `--trainer.callbacks` that watches each scored rollout
(`RolloutCallback`). The training step itself only knows the plain hook; `algos.wiring` hands it the trainer's
callbacks that have it. Advantage shapers are not callbacks: they are the model's `shapers` section.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.context import RolloutObserver


class RolloutCallback(RolloutObserver, Callback):
    """A Lightning callback that also sees each freshly generated, scored rollout batch."""


def rollout_callbacks(trainer: L.Trainer) -> list[RolloutObserver]:
    return [cb for cb in trainer.callbacks if isinstance(cb, RolloutObserver)]
