"""The rollout engine a module trains with, built from the `rollout:` section once the policy exists, and
the dtypes the engine and the trainer compute in (they set the weight-sync probe's tolerance)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.device_defaults import Accelerator
from rlvr_lightning.environments.base import Environment
from rlvr_lightning.models.lora import LoraSettings, warn_on_merged_half_precision
from rlvr_lightning.rollout.engine import LogprobsFn, RolloutEngine
from rlvr_lightning.rollout.settings import EngineSite, vllm_auto_dtype


def trainer_compute_dtype(precision: str, fsdp_param_dtype: str | None) -> str:
    """The dtype the trainer's forwards compute in, for Lightning's `trainer.precision` and FSDP2's parameter
    dtype (None without FSDP2); a function so that `rlvr_lightning.doctor` reads it from the configuration."""
    if precision.startswith("bf16") or fsdp_param_dtype == "bfloat16":
        return "bfloat16"
    return "float16" if precision.startswith("16") else "float32"


def engine_compute_dtype(rollout: Any, policy_config: Any, trainer_dtype: str, accelerator: Accelerator) -> str:
    """The dtype the rollout engine computes in on `accelerator`, for the run and
    for `rlvr_lightning.doctor` alike: `rollout.dtype`; `auto`: what vLLM makes of the checkpoint's dtype
    (`policy_config.dtype`); the HF engine is the trainer's own module."""
    if rollout.engine == "hf":
        return trainer_dtype
    if rollout.dtype != "auto":
        return rollout.dtype
    checkpoint = str(getattr(policy_config, "dtype", None) or getattr(policy_config, "torch_dtype", None) or "float32")
    return vllm_auto_dtype(checkpoint.removeprefix("torch."), accelerator.is_cuda, accelerator.bf16)


@dataclass(frozen=True)
class EngineSpec:
    """What builds this rank's engine and what it is handed at a sync: plain values, read from the run once
    (`algos.wiring.engine_spec`); no trainer or data module is kept."""

    rollout: Any  # the `rollout:` settings (`rollout.settings.RolloutSettings`)
    policy_path: str  # where the policy's weights and config are
    max_model_len: int  # prompt + response, the engine's context
    seed: int  # the run's seed (`data.seed`)
    tokenizer: Any
    ranks: RankPlace  # this rank among the trainer's
    make_environment: Callable[[], Environment | None]  # the environment answers are generated in, made on first use
    policy: torch.nn.Module
    lora: LoraSettings | None
    engine_dtype: str  # what the engine computes in (`engine_compute_dtype`)
    trainer_dtype: str  # what the trainer's forwards compute in (`trainer_compute_dtype`)
    chunk_tokens: int  # the LM head's chunk where the trainer's module scores (the probe, the HF engine)
    barrier: Callable[[], None] | None = None  # the trainer's ranks' barrier; None: one process


@dataclass(frozen=True)
class RankPlace:
    global_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    num_devices: int = 1  # the trainer's devices on this node


def build_rollout_engine(spec: EngineSpec, trainer_logprobs: LogprobsFn) -> RolloutEngine:
    """The engine of the `rollout:` section for this rank; warns (once) where a merged LoRA sync would lose updates.
    `trainer_logprobs`: the trainer's log-probs of one sequence (what the HF engine, the trainer's own module, scores with)."""
    lora, ranks = spec.lora, spec.ranks
    adapter_rank = lora.engine_max_rank if lora is not None and lora.sync == "adapter" else None
    engine = spec.rollout.build_engine(
        EngineSite(
            spec.policy_path,
            spec.max_model_len,
            spec.seed,
            spec.policy,
            trainer_logprobs,
            spec.tokenizer,
            ranks.global_rank,
            ranks.world_size,
            ranks.local_rank,
            ranks.num_devices,
            adapter_rank,
        )
    )
    if spec.rollout.engine != "hf" and ranks.global_rank == 0:
        warn_on_merged_half_precision(lora, spec.engine_dtype)
    return engine
