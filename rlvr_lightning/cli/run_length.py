"""The run's length, given once as `rollout_batches`, into Lightning's `trainer.max_steps`."""

from __future__ import annotations

from jsonargparse import Namespace

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.training.settings import optimizer_steps_per_rollout_batch


def resolve_run_length(cfg: Namespace) -> None:
    """`rollout_batches` into Lightning's `trainer.max_steps`, which counts optimizer steps: K = num_mini_batches ×
    ppo_epochs of them per rollout batch. The run's length is given once: a preset says 160, whatever its K."""
    batches = cfg.get("rollout_batches")
    if batches is None:
        return
    if batches < 1:
        raise ConfigError(f"rollout_batches={batches}: the run's length must be ≥ 1 rollout batch")
    max_steps = cfg.trainer.max_steps
    if max_steps not in (None, -1):
        raise ConfigError(
            f"rollout_batches={batches} and trainer.max_steps={max_steps} both set the run's length: give it once, as "
            "--rollout_batches (trainer.max_steps counts optimizer steps; --rollout_batches null leaves it to them)"
        )
    cfg.trainer.max_steps = batches * optimizer_steps_per_rollout_batch(cfg.model.init_args)
