"""The run's progress bar counts rollout batches, unless the user turned it off or configured their own."""

from __future__ import annotations

from jsonargparse import Namespace


def use_rollout_progress_bar(trainer_cfg: Namespace) -> None:
    """Lightning's default progress bar counts epochs and optimizer steps; ours counts rollout batches.
    Added here rather than in a config's callback list, so that `--trainer.enable_progress_bar=false`
    still works and a progress bar a user configures wins."""
    callbacks = trainer_cfg.callbacks or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    if trainer_cfg.enable_progress_bar is False or any(
        "ProgressBar" in str(c.get("class_path", "")) for c in callbacks
    ):
        return
    trainer_cfg.callbacks = [
        *callbacks,
        Namespace(class_path="rlvr_lightning.callbacks.progress.RolloutProgressBar", init_args=Namespace()),
    ]
