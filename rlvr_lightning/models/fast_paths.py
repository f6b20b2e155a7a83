"""Faster kernels for the policy's decoder layers, each behind a `model.compute` setting and off by default until
`make gpu-check` has measured it on a card (docs/gpu.md, "Fast paths"):

- `compile_layers`: `torch.compile` of each decoder layer's forward. Only the forward is compiled: FSDP2's
  gathers and activation checkpointing's recomputation are hooks around it and stay eager, so the compiled code
  never traces a collective. The first micro-batches pay the compilation (seconds per shape on a GPU, tens on
  a CPU; after the second shape the layer is compiled for dynamic lengths).
- `fused_kernels: liger`: Liger's Triton kernels for RMSNorm, SwiGLU and the rotary embedding, CUDA only. The LM
  head stays this library's chunked log-probs (`models.lm_head`): Liger's fused linear cross-entropy returns a
  scalar loss with its gradient computed inside the forward, and the losses here need each token's log-prob
  with any upstream gradient. Liger also patches transformers' module of the family (its RMSNorm and MLP classes
  and its rotary function), so every model of that family the process builds afterwards (a reference, a
  teacher, the planner's fake model) gets them too.
"""

from __future__ import annotations

import importlib.util

import torch

from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.parallel import decoder_layers

FUSED_KERNELS = ("none", "liger")
# How far a fast path's first update may sit from the plain path's on the same weights and tokens, where the
# update's meaning is the same and only bf16's rounding differs: it moves the loss by 1e-4 nats or less and the
# gradient's norm by 1e-3 at prime-rl's A1 setup. `make gpu-check` and `make doctor` hold the fast paths to it.
LOSS_TOLERANCE = 3e-3  # nats
GRAD_NORM_TOLERANCE = 1e-2  # relative


def disagreement(loss_gap: float, grad_norm_gap: float) -> str | None:
    """Why a fast path whose first loss is `loss_gap` nats and whose gradient norm is `grad_norm_gap` (relative)
    from the plain path's changes the update, or None where both are within rounding."""
    if abs(loss_gap) <= LOSS_TOLERANCE and abs(grad_norm_gap) <= GRAD_NORM_TOLERANCE:
        return None
    return (f"first loss {loss_gap:+.2e} nats and gradient norm {grad_norm_gap:+.2%} from the plain path's "
            f"(tolerances {LOSS_TOLERANCE}, {GRAD_NORM_TOLERANCE:.0%}): a fast path that changes the update")  # fmt: skip


def apply_fast_paths(model: torch.nn.Module, compile_layers: bool = False, fused_kernels: str = "none") -> None:
    """The chosen fast paths applied to `model` in place (before or after `fully_shard`: both act inside its
    layers' forwards)."""
    check_choice("model.compute.fused_kernels", fused_kernels, FUSED_KERNELS)
    if fused_kernels == "liger":
        _liger(model)
    if compile_layers:
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward)


def _liger(model: torch.nn.Module) -> None:
    if not torch.cuda.is_available():
        raise ConfigError("model.compute.fused_kernels liger: Liger's kernels are Triton kernels for CUDA; this machine has no CUDA device")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.compute.fused_kernels liger: the liger-kernel package is not installed (pip install liger-kernel)")
    from liger_kernel.transformers import monkey_patch

    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a LoRA adapter: PEFT's wrapper
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"model.compute.fused_kernels liger: Liger has no kernels for the {model_type!r} family")
    monkey_patch._apply_liger_kernel_to_instance(
        model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
