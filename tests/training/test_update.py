"""Non-finite guard: an update whose loss or gradient is NaN/inf is skipped with the weights and
the optimizer state untouched, logged, and a run that keeps producing them stops with a clear message."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.objective import Objective
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings


def poison_loss(monkeypatch) -> None:
    """Every micro-batch loss becomes NaN (what bad batch arithmetic or an overflow produces)."""
    clean = Objective.micro_batch_loss

    def nan_loss(self, mb, logp, norms, *rest):
        loss, stats = clean(self, mb, logp, norms, *rest)
        return loss * float("nan"), stats

    monkeypatch.setattr(Objective, "micro_batch_loss", nan_loss)


def test_nan_update_is_skipped_with_weights_unchanged_then_stops(tiny_policy_dir, monkeypatch):
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=4, val_data=None, rollout=RolloutSettings(group_size=4, max_response_length=8, engine="hf"))  # fmt: skip
    module = standalone(GRPO(optim=OptimSettings(lr=1e-2), compute=ComputeSettings(max_nonfinite_steps=2)), dm, callbacks=[])
    try:
        batch = next(iter(dm.train_dataloader()))
        before = {k: v.clone() for k, v in module.policy.state_dict().items()}
        poison_loss(monkeypatch)
        metrics = module.train_on_batch(batch).metrics
        assert metrics["skipped_updates"] == 1.0
        for name, value in module.policy.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert all(p.grad is None for p in module.policy.parameters())  # no NaN gradient left behind
        assert not module.optimizers().optimizer.state  # AdamW never stepped: its moments are not poisoned
        with pytest.raises(RuntimeError, match="2 consecutive updates had a non-finite loss or gradient"):
            module.train_on_batch(batch)
    finally:
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")
        module.teardown("fit")
