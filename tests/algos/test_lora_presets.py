"""Every preset trains a LoRA policy: its pieces, its own stages (DAPO's dynamic sampling, REAL's two passes) and
its callbacks (THR's head, OAR's embedding gradients) run through the adapted model, and the update moves the
adapter alone. One rollout batch each, sampled by the HF engine on a tiny policy."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml

from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.models.lora import LoraSettings
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.settings import OptimSettings
from tests.support.cli import REPO
from tests.support.rewards import PARITY

PRESETS = sorted((REPO / "configs/algo").glob("*.yaml"))


def instantiate(spec: dict, **extra):
    module_name, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), name)(**{**(spec.get("init_args") or {}), **extra})


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_trains_the_adapter_of_a_lora_policy(preset: Path, tiny_policy_dir, quick_warm_start):
    cfg = yaml.safe_load(preset.read_text())
    init_args = cfg["model"]["init_args"]
    optim = OptimSettings(**{**init_args.get("optim", {}), "lr": 1e-2})
    extra = {}
    if "teacher" in init_args:  # the session's quick warm start teaches: building the preset's own takes minutes
        extra["teacher"] = {**init_args["teacher"], "model_name_or_path": str(quick_warm_start[1])}
    rewards = RewardSettings(correctness=PARITY)  # correctness the untrained policy earns: mixed groups
    module = instantiate(cfg["model"], lora=LoraSettings(rank=4), optim=optim, rewards=rewards, **extra)
    callbacks = [instantiate(c) for c in (cfg.get("trainer") or {}).get("callbacks+", [])]
    rollout = RolloutSettings(engine="hf", group_size=8, max_response_length=12)  # G = 8: pass@k takes k = 4
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None, rollout=rollout)
    module = standalone(module, dm, callbacks=callbacks)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    try:
        result = module.train_on_batch(next(iter(dm.train_dataloader())))
    finally:
        module.teardown("fit")
    assert result is not None, "no update: the parity correctness gives mixed groups"
    assert all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values() if isinstance(v, float))
    after = module.policy.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(".lora_" in k for k in moved), moved[:5]
