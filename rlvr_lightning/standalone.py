"""Use an algorithm module outside `Trainer.fit`: in a notebook, a benchmark or a test.

Lightning gives a module its trainer, datamodule and model only inside `fit`. `standalone()`
wires the same objects with a bare CPU/GPU Trainer so that `module.train_on_batch`, each stage of
`rlvr_lightning.training` and the advantage shapers run exactly as in training. (Evaluating a
model needs no module: `rlvr_lightning.evaluate`.)
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.algos.wiring import engine_spec
from rlvr_lightning.data.datamodule import RolloutDataModule


def standalone(
    module: RLVRModule,
    datamodule: RolloutDataModule,
    callbacks: Sequence[Callback] = (),
    accelerator: str = "cpu",
    logger: Logger | bool = False,
) -> RLVRModule:
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    # What `fit` attaches, through the public attributes (the callbacks and the step read `trainer.datamodule`).
    trainer.datamodule, datamodule.trainer, module.trainer = datamodule, trainer, trainer
    trainer.strategy.connect(module)
    datamodule.setup("fit")
    module.configure_model()
    module.to(trainer.strategy.root_device)
    trainer.strategy.setup_optimizers(trainer)  # module.optimizers() / lr_schedulers(), as in fit
    module.session.attach(engine_spec(module))  # as on_fit_start: the policy is on its device
    return module
