"""The rollout engine a module trains with, built from the `rollout:` section once the policy exists, and
the dtypes the engine and the trainer compute in (they set the weight-sync probe's tolerance)."""

from __future__ import annotations

from typing import Any

import torch

from rlvr_lightning.device_defaults import Accelerator
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


def build_rollout_engine(
    datamodule: Any,
    trainer: Any,
    policy: torch.nn.Module,
    lora: LoraSettings | None,
    engine_dtype: str,
    trainer_logprobs: LogprobsFn,
) -> RolloutEngine:
    """The engine of the `rollout:` section for this rank; warns (once) where a merged LoRA sync would lose updates.
    `trainer_logprobs`: the trainer's log-probs of one sequence (what the HF engine, the trainer's own module, scores with)."""
    adapter_rank = lora.engine_max_rank if lora is not None and lora.sync == "adapter" else None
    engine = datamodule.rollout.build_engine(
        EngineSite(
            datamodule.policy_path,
            datamodule.max_model_len(),
            datamodule.hparams.seed,
            policy,
            trainer_logprobs,
            datamodule.tokenizer,
            trainer.global_rank,
            trainer.world_size,
            trainer.local_rank,
            trainer.num_devices,
            adapter_rank,
        )
    )
    if datamodule.rollout.engine != "hf" and trainer.is_global_zero:
        warn_on_merged_half_precision(lora, engine_dtype)
    return engine
