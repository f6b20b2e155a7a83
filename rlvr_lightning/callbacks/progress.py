"""The terminal progress bar, counted in rollout batches.

Lightning's bar counts the dataloader's batches per epoch against `max_steps`, which counts optimizer
steps: with K optimizer steps per rollout batch it ends at a quarter for K = 4, an `-1` max_epochs
shows in its label, and it restarts every pass over the prompts. This one shows the whole run: rollout
batches done out of the run's total (a resumed run starts where it left off), its ETA, and the latest
reward, accuracy and held-out accuracy.
"""

from __future__ import annotations

import math

from lightning.pytorch.callbacks import TQDMProgressBar


def rollout_batches_total(trainer, module) -> int | float:
    """Rollout batches the run will train: max_steps / (optimizer steps per rollout batch), else
    max_epochs passes over the prompts; inf when neither bounds the run."""
    per_batch = module.settings.optimizer_steps_per_rollout_batch
    if trainer.max_steps and trainer.max_steps > 0:
        return math.ceil(trainer.max_steps / per_batch)
    if trainer.max_epochs and trainer.max_epochs > 0 and trainer.num_training_batches != math.inf:
        return trainer.max_epochs * trainer.num_training_batches
    return math.inf


def bar_metrics(metrics: dict[str, float], latest_val: dict[str, float]) -> dict[str, float]:
    """What a trained rollout batch shows on the progress bar: its reward and accuracy, and the latest held-out
    accuracy once there is one."""
    bar = {"reward": metrics["train/reward_mean"], "acc": metrics["train/accuracy"]}
    if "val/accuracy" in latest_val:
        bar["val_acc"] = latest_val["val/accuracy"]
    return bar


class RolloutProgressBar(TQDMProgressBar):
    SHOWN = {"reward": "reward", "acc": "acc", "val_acc": "val acc"}  # progress-bar metric → label

    @property
    def train_description(self) -> str:
        return "rollout batches"

    def on_train_start(self, trainer, module) -> None:
        super().on_train_start(trainer, module)
        total = rollout_batches_total(trainer, module)
        bar = self.train_progress_bar
        bar.reset(total=None if total == math.inf else total)
        bar.initial = bar.n = module.rollout_batches  # a resumed run starts where it left off

    def on_train_epoch_start(self, trainer, module) -> None:
        pass  # one bar for the run, not one per pass over the prompts

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar.disable:
            return
        bar.n = module.rollout_batches
        metrics = self.get_metrics(trainer, module)
        bar.set_postfix({label: metrics[key] for key, label in self.SHOWN.items() if key in metrics}, refresh=False)
        bar.refresh()

    def on_train_epoch_end(self, trainer, module) -> None:
        pass  # the bar lives on to the next pass
