"""`ResumableCheckpoint.save` writes `last.json` before it renames the checkpoint into place: a save killed at
either step leaves a `last.ckpt` its record vouches for (`checkpoint_record.py`). The kill is injected into the
real save, in the record's write and in the rename."""

from __future__ import annotations

import os

import pytest

from rlvr_lightning import checkpoint_record
from rlvr_lightning.algos import GRPO
from rlvr_lightning.callbacks.checkpoint import ResumableCheckpoint
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.standalone import standalone


class Killed(BaseException):
    """Where a kill would stop the save."""


@pytest.mark.e2e
@pytest.mark.parametrize("killed_in", ["the record's write", "the checkpoint's rename"])
def test_a_save_killed_midway_leaves_a_checkpoint_that_its_record_vouches_for(tmp_path, quick_warm_start, monkeypatch, killed_in):
    dm = RolloutDataModule(model_name_or_path=str(quick_warm_start[1]), batch_size=4, val_data=None,
                           rollout=RolloutSettings(group_size=2, max_response_length=8, engine="hf"))  # fmt: skip
    saver = ResumableCheckpoint(dirpath=str(tmp_path))
    module = standalone(GRPO(), dm)  # the saver is called directly (a bare Trainer takes no checkpoint callback)
    try:
        first = saver.save(module.trainer, module)
        module.rollout_batches = 1
        with monkeypatch.context() as patch:
            real_replace = os.replace

            def replace(src, dst):
                if (killed_in == "the record's write") == str(dst).endswith("last.json"):
                    raise Killed
                real_replace(src, dst)

            patch.setattr(os, "replace", replace)
            with pytest.raises(Killed):
                saver.save(module.trainer, module)
        assert checkpoint_record.verify(first)["rollout_batches"] == 0  # the checkpoint before, as its record says
        checkpoint_record.tidy(first.parent)
        assert sorted(p.name for p in first.parent.iterdir()) == ["last.ckpt", "last.json"]
        saver.save(module.trainer, module)
        assert checkpoint_record.verify(first)["rollout_batches"] == 1
    finally:
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")
        module.teardown("fit")
