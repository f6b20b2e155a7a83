"""Export the policy in Hugging Face format (`save_pretrained` layout with its tokenizer), which
transformers and vLLM load directly: `<dirpath>/step-<N>` every N rollout batches, and `<dirpath>/final`.

Lightning's own checkpoints hold the optimizer and the training state (for resuming); these hold
only what inference needs. The MLflow run records where each export went (`export/<name>` tags).

A LoRA policy is exported as a PEFT adapter directory (`adapter_model.safetensors`, `adapter_config.json`
naming its base model, and the tokenizer), which PEFT, vLLM's `LoRARequest` and `make eval` load; with
`merged: true` also as full HF weights (W + scale·B·A) in `<name>-merged`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks.checkpoint import ResumableCheckpoint, write_failure
from rlvr_lightning.callbacks.periodic import is_due
from rlvr_lightning.models.embedded import save_policy
from rlvr_lightning.models.lora import adapter_config, adapter_weights, save_adapter
from rlvr_lightning.models.weights import full_weights

log = logging.getLogger(__name__)


class HFExport(Callback):
    def __init__(self, dirpath: str = "exports", every_n_steps: int = 0, final: bool = True, merged: bool = False) -> None:
        """
        Args:
            dirpath: parent directory; each export goes to a sub-directory named after the run.
            every_n_steps: export after every N rollout batches (0 = never during training).
            final: export when training ends.
            merged: a LoRA policy: also export its merged full weights (`<name>-merged`) beside the adapter.
        """
        self.dirpath, self.every_n_steps, self.final, self.merged = Path(dirpath), every_n_steps, final, merged
        self.failures = 0  # exports that could not be written, this process

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if is_due(pl_module.rollout_batches, self.every_n_steps):
            self.export(trainer, pl_module, f"step-{pl_module.rollout_batches}")

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.final:
            self.export(trainer, pl_module, "final")

    def export(self, trainer: L.Trainer, pl_module, name: str) -> Path | None:
        """The export's directory (a LoRA policy's: its adapter); None when it could not be written."""
        # Every rank takes part in gathering sharded (FSDP) weights; rank 0 writes them.
        out, lora = self.run_dir(trainer) / name, pl_module.settings.lora
        written = True
        if lora is not None:
            adapter = dict(adapter_weights(pl_module.policy))
            if trainer.is_global_zero:
                written = self._guarded(
                    trainer, pl_module, out, lambda: self._write_adapter(trainer, pl_module, name, adapter, out)
                )
        if lora is None or self.merged:
            weights, full = dict(full_weights(pl_module.policy)), out if lora is None else out.with_name(f"{name}-merged")
            if trainer.is_global_zero:
                written &= self._guarded(
                    trainer, pl_module, full, lambda: self._write(trainer, pl_module, full.name, weights, full)
                )
        trainer.strategy.barrier("hf export")
        return out if written else None

    def _guarded(self, trainer: L.Trainer, pl_module, out: Path, write) -> bool:
        """`write()`, or, when the file system refuses it (a full disk, an unwritable directory), a warning, the
        partial export removed and `train/export_failures` counted: an export never fails a run whose
        checkpoint holds the same weights."""
        try:
            write()
            return True
        except Exception as err:
            failure = write_failure(err)
            if failure is None:
                raise
        shutil.rmtree(out, ignore_errors=True)
        self.failures += 1
        saver = next((cb for cb in trainer.callbacks if isinstance(cb, ResumableCheckpoint)), None)
        kept = saver.last_saved(trainer) if saver is not None else None
        kept = (
            f"checkpoint {kept[0]} (rollout batch {kept[1]}) holds the weights" if kept else "no checkpoint holds them"
        )
        log.warning(
            "export %s not written (%s); %s (`make eval CKPT=…` reads a checkpoint as it is)", out, failure, kept
        )
        for logger in trainer.loggers:
            logger.log_metrics({"train/export_failures": float(self.failures)}, step=pl_module.rollout_batches)
        return False

    def _write_adapter(self, trainer: L.Trainer, pl_module, name: str, adapter: dict, out: Path) -> None:
        config = adapter_config(pl_module.settings.lora, pl_module.policy, trainer.datamodule.policy_path)
        save_adapter(adapter, config, out)
        trainer.datamodule.tokenizer.save_pretrained(out)
        self._record(trainer, pl_module, name, out)

    def run_dir(self, trainer: L.Trainer) -> Path:
        return self.dirpath / str(getattr(trainer.logger, "run_id", None) or "run")

    def _write(self, trainer: L.Trainer, pl_module, name: str, weights: dict, out: Path) -> None:
        config = pl_module.policy.config
        use_cache, config.use_cache = config.use_cache, True  # training turns the KV cache off; inference wants it
        try:
            save_policy(pl_module.policy, trainer.datamodule.tokenizer, out, state_dict=weights)
        finally:
            config.use_cache = use_cache
        self._record(trainer, pl_module, name, out)

    def _record(self, trainer: L.Trainer, pl_module, name: str, out: Path) -> None:
        """What the export holds (`rlvr_export.json`) and where it went (the MLflow run's `export/<name>` tag)."""
        meta = {
            "rollout_batches": pl_module.rollout_batches,
            "policy_version": pl_module.session.policy_version,
            "algorithm": type(pl_module).__name__,
            "mlflow_run_id": getattr(trainer.logger, "run_id", None),
        }
        (out / "rlvr_export.json").write_text(json.dumps(meta, indent=2))
        # An MLflow client has `set_tag`; another logger's experiment (Lightning's CSVLogger's writer) has not.
        experiment = getattr(trainer.logger, "experiment", None)
        if hasattr(experiment, "set_tag"):
            experiment.set_tag(trainer.logger.run_id, f"export/{name}", str(out.resolve()))
