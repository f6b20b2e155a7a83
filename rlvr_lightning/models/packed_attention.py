"""Attention over packed sequences on CUDA without a dense [S × S] mask.

Given packed position ids and no attention mask, transformers builds a block-diagonal causal mask
for sdpa and eager attention: correct (it is the CPU path), but an [S × S] tensor per forward, and
sdpa with a mask cannot use its flash kernel. On CUDA the policy's attention is therefore switched,
once, from `sdpa` to:
  - transformers' own `flash_attention_2` where the `flash_attn` package is installed: it reads the
    sequence boundaries from the `cu_seq_lens_*` / `max_length_*` keywords of the packed forward;
  - otherwise `PACKED_SDPA`, registered here through transformers' `AttentionInterface`: with those
    keywords it calls PyTorch's own varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`),
    without them it is exactly transformers' `sdpa` (padded micro-batches, generation with a KV cache).
    Its mask function (`AttentionMaskInterface`) builds sdpa's masks except inside a packed forward
    (`packed_forward()`), where it builds none.
The choice is per call, by the keywords, not by a mode of the model, so activation checkpointing's
recomputation in the backward (outside the packed forward) takes the same path as the forward did.
Where the varlen kernel cannot run (not CUDA, fp32, a logit soft-cap, dropout, a sliding window this
PyTorch's kernel does not take), each sequence gets its own causal sdpa call: no [S × S] mask either.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import torch

from rlvr_lightning.models.packing import PackedLayout

PACKED_SDPA = "rlvr_packed_sdpa"
_VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4", PACKED_SDPA)
_in_packed_forward: ContextVar[bool] = ContextVar("rlvr_in_packed_forward", default=False)


def attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def takes_cu_seqlens(model: torch.nn.Module) -> bool:
    """Whether the model's attention reads the sequence boundaries from the forward's keywords."""
    return attention_implementation(model) in _VARLEN_IMPLEMENTATIONS


def varlen_kwargs(model: torch.nn.Module, layout: PackedLayout) -> dict:
    """The keywords a packed forward passes the model: the boundaries, where its attention reads them."""
    if not takes_cu_seqlens(model):
        return {}
    cu = layout.cu_seqlens
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": layout.max_length,
        "max_length_k": layout.max_length,
    }


def prepare_packed_attention(model: torch.nn.Module, force: bool = False) -> str | None:
    """Switch a CUDA model's `sdpa` attention to a varlen one (see the module's docstring); idempotent.
    Other implementations, and models on other devices (unless `force`: the tests), are left as they are:
    transformers' block-diagonal mask serves them. Returns the implementation in use."""
    current = attention_implementation(model)
    if current != "sdpa":
        return current
    if not force and not next(iter(model.parameters())).is_cuda:
        return current
    target = "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else PACKED_SDPA
    register()
    _pretrained(model).set_attn_implementation(target)
    return attention_implementation(model)


def _pretrained(model: torch.nn.Module):
    """The transformers model inside wrappers (PEFT, the LoRA reference view)."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


@cache
def register() -> None:
    """Register `PACKED_SDPA` with transformers (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)


@contextmanager
def packed_forward() -> Iterator[None]:
    """Marks the model forward run inside it as a packed one: `PACKED_SDPA` then builds no mask."""
    token = _in_packed_forward.set(True)
    try:
        yield
    finally:
        _in_packed_forward.reset(token)


def _packed_sdpa_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if _in_packed_forward.get() else sdpa_mask(*args, **kwargs)


def packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function contract: query [b, Hq, S, D], key/value [b, Hkv, S, D] →
    ([b, S, Hq, D], None). Packed (the `cu_seq_lens_q` keyword): b = 1, sequences bounded by it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("a packed forward is one row of sequences with no attention mask")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, H, D]
    out = varlen_causal_attention(
        q,
        k,
        v,
        cu,
        int(kwargs.get("max_length_q") or 0),
        kwargs.get("scaling"),
        kwargs.get("sliding_window"),
        kwargs.get("softcap"),
        kwargs.get("dropout", 0.0),
    )
    return out[None], None


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sequence of q [S, Hq, D], k/v [S, Hkv, D] (Hq a multiple of Hkv),
    sequence i spanning rows cu_seqlens[i]:cu_seqlens[i+1]; a sliding window of W lets a token see the
    W − 1 tokens before it (transformers' convention). Returns [S, Hq, D]."""
    kernel = _varlen_kernel()
    usable = (
        kernel is not None
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and softcap is None
        and dropout == 0.0
        and (sliding_window is None or "window_size" in kernel[1])
    )
    if usable:
        return _torch_varlen(kernel, q, k, v, cu_seqlens, max_length, scale, sliding_window)
    return _per_sequence(q, k, v, cu_seqlens, scale, sliding_window, dropout)


@cache
def _varlen_kernel():
    """(PyTorch's `varlen_attn`, its parameter names), or None where this PyTorch has none. Its keywords
    changed across releases (`is_causal` → `window_size`; `enable_gqa` is newer), hence the names."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(kernel, q, k, v, cu_seqlens, max_length, scale, sliding_window) -> torch.Tensor:
    fn, params = kernel
    kw: dict = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)  # (left, right): causal
    else:
        kw["is_causal"] = True
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_length, max_length, **kw)


def _per_sequence(q, k, v, cu_seqlens, scale, sliding_window, dropout) -> torch.Tensor:
    """One causal sdpa call per sequence (the fallback; a mask only for a sliding window shorter than it)."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, L, D]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        mask = None
        if sliding_window is not None and e - s > sliding_window:
            i = torch.arange(e - s, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scale
        )
        out.append(attn.transpose(0, 1))
    return torch.cat(out)
