"""Attention as the planner runs it: a GPU's fused causal kernel stood in for by SDPA's (on the CPU its flash
kernel, O(T) memory), and the FLOPs of that CPU kernel, which PyTorch's FLOP counter has no formula for."""

from __future__ import annotations

import torch


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of SDPA's CPU flash kernel (absent from PyTorch's FLOP formulas): QKᵀ and PV, 2 FLOPs per
    multiply-add, half of it under a causal mask (what the GPU's kernels compute too)."""
    b, h, s_q, d = query_shape
    s_k = key_shape[-2]
    is_causal = bool(args[1]) if len(args) > 1 else bool(kwargs.get("is_causal", False))
    return int(4 * b * h * s_q * s_k * d * (0.5 if is_causal else 1.0))


def _attention_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    """Backward: five matmuls of the forward's two (PyTorch's own SDPA backward formula, 2.5×)."""
    is_causal = bool(args[3]) if len(args) > 3 else bool(kwargs.get("is_causal", False))
    return int(2.5 * _attention_flops(query_shape, key_shape, value_shape, 0.0, is_causal))


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


def fused_causal_attention() -> str:
    """The name of an attention function for transformers that runs SDPA's causal kernel without a mask
    (on the CPU: its flash kernel, O(T) memory like a GPU's fused kernels)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fused_causal(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("rlvr_plan_fused_causal", fused_causal)
    return "rlvr_plan_fused_causal"
