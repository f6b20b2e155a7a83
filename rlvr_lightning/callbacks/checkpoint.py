"""Checkpoints that a killed run resumes from exactly, into the same MLflow run.

    make train ALGO=grpo                                    # writes checkpoints/<mlflow run id>/last.ckpt
    make train ALGO=grpo RESUME=checkpoints/<run id>/last.ckpt

What a resumed run needs and where it comes from:
- model, optimizer, LR schedule, global step, loop progress: Lightning's checkpoint;
- policy version and completed rollout batches (the data position, see `ResumableBatches`): the module;
- DAPO's extra-prompt stream: the data module's state;
- the last evaluated step (no duplicate evaluation on resume): the `Evaluation` callback's state;
- the rollout engine's weights: `RLVRModule.on_train_start`, after every strategy has restored;
- RNG: this callback, for every rank. The in-process vLLM engine on CPU and the HF engine sample
  from the process-wide torch generator, so restoring it after the engine is rebuilt makes the
  resumed rollouts the ones the uninterrupted run would have drawn;
- the MLflow run id: stored in the checkpoint; the CLI reopens that run (`cli/mlflow_resume.py`).

`last.ckpt` is replaced atomically (written beside it, then renamed), so a kill during a save leaves
the previous checkpoint intact. `last.json` beside it says which step it holds and its digest, in an order
that cannot disagree with it after a kill (`checkpoint_record.py`); a resume verifies it. The run's
directory is locked by the process training it (`run_lock.py`).
A save that cannot be written (a full disk, an unwritable directory) on any rank is dropped on every rank:
the previous checkpoint stays, a warning says which step it holds, and training goes on
(`train/checkpoint_failures` counts them).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from rlvr_lightning import checkpoint_record
from rlvr_lightning.callbacks.periodic import is_due
from rlvr_lightning.errors import ConfigError, error_chain
from rlvr_lightning.run_lock import hold_run_directory, release_run_directory
from rlvr_lightning.slurm_requeue import record_job_checkpoint

log = logging.getLogger(__name__)


def write_failure(err: BaseException) -> OSError | None:
    """The file-system error behind a failed write, if that is what it was (PyTorch's distributed checkpoint
    wraps each rank's in its own exception; safetensors raises its own error quoting the OS's, `(os error 28)`)."""
    for cause in error_chain(err):
        if isinstance(cause, OSError):
            return cause
        os_error = re.search(r"I/O error: .*\(os error (\d+)\)", str(cause))
        if os_error:
            code = int(os_error.group(1))
            return OSError(code, os.strerror(code))
    return None


def rng_state() -> dict:
    """The process's generators, as tensors and plain tuples only: checkpoints stay loadable with
    `torch.load(weights_only=True)` (LightningCLI reads them that way)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def non_finite_state(module: torch.nn.Module, optimizers) -> str | None:
    """The first weight or optimizer state holding a NaN or an inf on this rank (its shard, under FSDP), named;
    None when all are finite."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (a DTensor's own shard)
    for name, param in module.named_parameters():
        if not torch.isfinite(local(param.detach())).all():
            return f"weight {name}"
    for optimizer in optimizers:
        for index, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(local(value)).all():
                    return f"optimizer state {key} of parameter {index}"
    return None


class ResumableCheckpoint(Checkpoint):
    def __init__(self, dirpath: str = "checkpoints", every_n_steps: int = 20, save_on_train_end: bool = True) -> None:
        """
        Args:
            dirpath: parent directory; each run writes `<dirpath>/<MLflow run id>/last.ckpt`.
            every_n_steps: save after every N rollout batches (0 = only at the end).
            save_on_train_end: also save when training ends (to extend a finished run later).
        """
        self.dirpath, self.every_n_steps, self.save_on_train_end = Path(dirpath), every_n_steps, save_on_train_end
        self._restored_rng: list[dict] | None = None
        self.failures = 0  # saves that could not be written, this process
        self.saved_at: int | None = None  # the rollout batch this process last wrote a checkpoint at

    def run_dir(self, trainer: L.Trainer) -> Path:
        return self.dirpath / str(getattr(trainer.logger, "run_id", None) or "run")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if is_due(pl_module.rollout_batches, self.every_n_steps):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.save_on_train_end and not trainer.interrupted:
            self.save(trainer, pl_module)

    def save(self, trainer: L.Trainer, pl_module) -> Path | None:
        """The checkpoint written, or None when it could not be (the previous one stays)."""
        out = self.run_dir(trainer)
        last, tmp = out / "last.ckpt", out / "last.ckpt.tmp"
        failure = None
        try:
            trainer.save_checkpoint(tmp)  # every rank takes part (sharded strategies write one file per rank)
        except Exception as err:
            failure = write_failure(err)
            if failure is None:
                raise
        # Every rank drops the save if any rank could not write its part, so that all go on alike.
        if trainer.strategy.reduce_boolean_decision(failure is not None, all=False):
            self._dropped(trainer, out, tmp, failure)
            return None
        if trainer.is_global_zero:  # the record first, then the rename (`checkpoint_record`: kill-safe order)
            checkpoint_record.write(out, {
                "rollout_batches": pl_module.rollout_batches,
                "global_step": trainer.global_step,
                "policy_version": pl_module.session.policy_version,
                "mlflow_run_id": getattr(trainer.logger, "run_id", None),
                "checkpoint": str(last),
                "sha256": checkpoint_record.digest(tmp),
            })  # fmt: skip
            if last.is_dir():  # a sharded checkpoint is a directory: it cannot be renamed over
                old = out / "last.ckpt.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(last, old)
                os.replace(tmp, last)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, last)
        trainer.strategy.barrier("checkpoint saved")
        self.saved_at = pl_module.rollout_batches
        return last

    def last_saved(self, trainer: L.Trainer) -> tuple[Path, int] | None:
        """The run's checkpoint and the rollout batch it holds (`last.json`), if there is one."""
        out = self.run_dir(trainer)
        record = checkpoint_record.read(out)
        if record is None or not isinstance(record.get("rollout_batches"), int) or not (out / "last.ckpt").exists():
            return None
        return out / "last.ckpt", record["rollout_batches"]

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        """The run's directory held by this process for its life (`run_lock`), what an interrupted save left there
        put right, and, in a SLURM job, the checkpoint it writes recorded for the job's requeued start."""
        if stage == "fit" and trainer.is_global_zero:
            out = self.run_dir(trainer)
            hold_run_directory(out)
            record_job_checkpoint(self.dirpath, out / "last.ckpt", getattr(trainer.logger, "run_id", None))
            handled = checkpoint_record.tidy(out)
            if handled:
                log.info("%s: removed what an interrupted save left (%s)", out, ", ".join(handled))

    def _dropped(self, trainer: L.Trainer, out: Path, tmp: Path, failure: OSError | None) -> None:
        self.failures += 1
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            previous = self.last_saved(trainer)
            kept = f"the previous checkpoint {previous[0]} (rollout batch {previous[1]}) is intact" if previous else "there is no earlier checkpoint"
            why = failure if failure is not None else "another rank could not write its part"
            log.warning("checkpoint at rollout batch %d not written (%s); %s; training goes on",
                        trainer.lightning_module.rollout_batches, why, kept)  # fmt: skip
        for logger in trainer.loggers:
            logger.log_metrics({"train/checkpoint_failures": float(self.failures)}, step=trainer.lightning_module.rollout_batches)
        trainer.strategy.barrier("checkpoint dropped")

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            release_run_directory(self.run_dir(trainer))

    # ---- RNG of every rank, inside the checkpoint ------------------------------------------
    def state_dict(self) -> dict:
        states = [rng_state()]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            states = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, rng_state())
        return {"rng": states}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored_rng = state_dict.get("rng")

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.ckpt_path:  # every rank checks its own part of what was restored; any one refuses for all
            bad = non_finite_state(pl_module, trainer.optimizers)
            if trainer.strategy.reduce_boolean_decision(bad is not None, all=False):
                raise ConfigError(
                    f"ckpt_path: {trainer.ckpt_path} holds a non-finite {bad or 'tensor (on another rank)'} (NaN or "
                    "inf): a run resumed from it would train on garbage; resume from an earlier checkpoint"
                )
        # After the engine was rebuilt (its start-up reseeds the generator): continue the saved stream.
        if self._restored_rng:
            rank = trainer.global_rank if trainer.global_rank < len(self._restored_rng) else 0
            set_rng_state(self._restored_rng[rank])
            self._restored_rng = None
