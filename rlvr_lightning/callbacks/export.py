"""Export the policy in Hugging Face format (`save_pretrained` layout with its tokenizer), which
transformers and vLLM load directly: `<dirpath>/step-<N>` every N rollout batches, and `<dirpath>/final`.

Lightning's own checkpoints hold the optimizer and the training state (for resuming); these hold
only what inference needs. The MLflow run records where each export went (`export/<name>` tags).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks.periodic import is_due
from rlvr_lightning.models.embedded import save_policy
from rlvr_lightning.models.weights import full_weights


class HFExport(Callback):
    def __init__(self, dirpath: str = "exports", every_n_steps: int = 0, final: bool = True) -> None:
        """
        Args:
            dirpath: parent directory; each export goes to a sub-directory named after the run.
            every_n_steps: export after every N rollout batches (0 = never during training).
            final: export when training ends.
        """
        self.dirpath, self.every_n_steps, self.final = Path(dirpath), every_n_steps, final

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if is_due(pl_module.rollout_batches, self.every_n_steps):
            self.export(trainer, pl_module, f"step-{pl_module.rollout_batches}")

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.final:
            self.export(trainer, pl_module, "final")

    def export(self, trainer: L.Trainer, pl_module, name: str) -> Path:
        # Every rank takes part in gathering sharded (FSDP) weights; rank 0 writes them.
        weights = dict(full_weights(pl_module.policy))
        out = self.run_dir(trainer) / name
        if trainer.is_global_zero:
            self._write(trainer, pl_module, name, weights, out)
        trainer.strategy.barrier("hf export")
        return out

    def run_dir(self, trainer: L.Trainer) -> Path:
        return self.dirpath / str(getattr(trainer.logger, "run_id", None) or "run")

    def _write(self, trainer: L.Trainer, pl_module, name: str, weights: dict, out: Path) -> None:
        config = pl_module.policy.config
        use_cache, config.use_cache = config.use_cache, True  # training turns the KV cache off; inference wants it
        try:
            save_policy(pl_module.policy, trainer.datamodule.tokenizer, out, state_dict=weights)
        finally:
            config.use_cache = use_cache
        meta = {"rollout_batches": pl_module.rollout_batches, "policy_version": pl_module.policy_version,
                "algorithm": type(pl_module).__name__, "mlflow_run_id": getattr(trainer.logger, "run_id", None)}  # fmt: skip
        (out / "rlvr_export.json").write_text(json.dumps(meta, indent=2))
        if trainer.logger is not None and hasattr(trainer.logger, "experiment"):
            trainer.logger.experiment.set_tag(trainer.logger.run_id, f"export/{name}", str(out.resolve()))
