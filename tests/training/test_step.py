"""The training step holds plain values: nothing reachable from a built `TrainingStep` is a Trainer, a data module
or a LightningModule (it is built once, at fit start, from what `training/wiring.py` reads of them), and a module's
step is built once, not per rollout batch."""

from __future__ import annotations

import gc
import sys
import types

import lightning as L
import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO
from rlvr_lightning.callbacks.reward import RewardVerifier
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.step import StepResult
from tests.support.rewards import ParityReward

LIGHTNING_OWNED = (L.Trainer, L.LightningDataModule, L.LightningModule)


def lightning_objects_reachable(root) -> list[str]:
    """Every Trainer, LightningDataModule or LightningModule reachable from `root` through references, by the
    path of types that leads there (modules, classes and functions' globals are not followed: they reach anything)."""
    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    seen, found, todo = {id(root)}, [], [(root, type(root).__name__)]
    while todo:
        obj, path = todo.pop()
        if isinstance(obj, LIGHTNING_OWNED):
            found.append(path)
            continue
        for ref in gc.get_referents(obj):
            if id(ref) in seen or isinstance(ref, types.ModuleType | type | torch.Tensor) or id(ref) in module_dicts:
                continue
            if isinstance(obj, types.FunctionType) and ref is obj.__globals__:
                continue
            seen.add(id(ref))
            todo.append((ref, f"{path} → {type(ref).__name__}"))
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", [GRPO, DAPO])
def test_a_built_step_reaches_no_trainer_data_module_or_module_and_is_built_once(algorithm, quick_warm_start):
    dm = RolloutDataModule(model_name_or_path=str(quick_warm_start[1]), batch_size=4, val_data=None,
                           rollout=RolloutSettings(group_size=2, max_response_length=8, engine="hf"))  # fmt: skip
    module = standalone(algorithm(), dm, callbacks=[RewardVerifier(num_workers=1), ParityReward()])  # mixed groups for DAPO
    try:
        step = module.rlvr_step
        assert lightning_objects_reachable(step) == []
        for batch in list(dm.train_dataloader())[:2]:  # runs, and the same step serves every rollout batch
            assert isinstance(module.train_on_batch(batch), StepResult)
            module.rollout_batches += 1
            assert module.rlvr_step is step
        assert lightning_objects_reachable(step) == []  # nor after it ran (its engine, stream and environment built)
    finally:
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")
        module.teardown("fit")


def test_the_reachability_check_finds_a_trainer_behind_a_bound_method():
    """The check can fail: a step-like object keeping a module's bound method reaches the module."""
    holder = types.SimpleNamespace(callback=GRPO().configure_optimizers)
    assert lightning_objects_reachable(holder) == ["SimpleNamespace → dict → method → GRPO"]
