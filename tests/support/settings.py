"""Change a built module's settings in a test, as building it with them would have."""

from __future__ import annotations

import dataclasses

from rlvr_lightning.algos import wiring
from rlvr_lightning.training.settings import BehaviourSettings, ComputeSettings, OptimSettings, StepSettings

GROUPS = {"optim": OptimSettings, "compute": ComputeSettings, "behaviour": BehaviourSettings}


def resettle(module, **changes) -> None:
    """`module` runs its next step with `changes`: flat algorithm arguments by name, a group's fields by theirs
    (`micro_batch_size=4` changes `compute`); the pieces are bound and checked again, as at construction."""
    values = dict(module.hparams)
    for name, value in changes.items():
        group = next((g for g, cls in GROUPS.items() if name in {f.name for f in dataclasses.fields(cls)}), None)
        if group is None:
            values[name] = value
        else:
            values[group] = {**values[group], name: value}
    module.settings = StepSettings.of(values)
    module.hparams.update(module.settings.hparams())
    module.drop_step()  # the step is built from the settings: its next use builds it with these


def checked(module):
    """The module's training step, after the checks a run makes against its data, rollout settings and
    callbacks when it starts (`on_fit_start`)."""
    return wiring.training_step(module, check=True)
