"""Log-probs of the sampled tokens straight from the LM head's inputs, chunk by chunk.

Why not `log_softmax(model(...).logits)`: at a 151,936-token vocabulary the logits of one micro-batch
of 8 × 4k response tokens are ~20 GB in fp32, and autograd keeps them, their log-softmax and the
entropy's exp for the backward. Here the LM head runs over at most `chunk_tokens` tokens at a time;
the forward keeps only each token's log-sum-exp, and the backward recomputes the chunk's logits:

    z = h Wᵀ / T,   log π(y) = z_y − lse(z),   ∂log π(y)/∂z = onehot(y) − softmax(z)
    ∂/∂h = (∂/∂z) W / T,   ∂/∂W = (∂/∂z)ᵀ h / T

so memory is O(chunk_tokens × V) in both passes, for one extra LM-head product in the backward.
Families that transform the head's output (Granite's and MiniCPM3's logit scaling, Cohere's logit
scale, Gemma 2's soft-capping) get the same transform here (`HeadTransform`), its derivative in the
backward; THR's LM-head calls go through it too (`PolicyHead`).
Fused kernels (Liger's fused linear cross-entropy) compute the gradient inside the forward for a
scalar loss; our losses need the per-token log-probs themselves with any upstream gradient, which is
what this function provides on every device.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import record_function

# The families whose forward transforms the LM head's output, each held against the model's own logits
# (tests/models/test_lm_head_transforms.py). `logits_scaling` divides the logits, except where it multiplies them
# (HyperCLOVA X) or scales the head's input instead (MiniCPM3: the chunked path receives it scaled).
HEAD_TRANSFORM_FAMILIES = frozenset(
    {"granite", "granitemoe", "cohere", "cohere2", "gemma2", "gemma3_text", "hyperclovax", "minicpm3", "nanochat"}
)
MULTIPLIES_BY_LOGITS_SCALING = frozenset({"hyperclovax"})
SCALES_THE_HEAD_INPUT = frozenset({"minicpm3"})
# The settings a family's forward reads for its transform, each with the value that makes it a no-op.
NEUTRAL = {"logits_scaling": 1.0, "logit_scale": 1.0, "final_logit_softcapping": None}


@dataclass(frozen=True)
class HeadTransform:
    """What a family's forward does to `hidden @ weight.T` before returning it as logits:
    z = scale · raw, then z = softcap · tanh(z / softcap) when soft-capped."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        z = raw * self.scale if self.scale != 1.0 else raw
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def head_transform(config) -> HeadTransform:
    """The transform of `config`'s family (`HEAD_TRANSFORM_FAMILIES`), read from its configuration."""
    model_type, scale = getattr(config, "model_type", ""), 1.0
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1.0) and model_type not in SCALES_THE_HEAD_INPUT:
        scale = float(scaling) if model_type in MULTIPLIES_BY_LOGITS_SCALING else 1.0 / float(scaling)
    if getattr(config, "logit_scale", None) not in (None, 1.0):  # Cohere
        scale *= float(config.logit_scale)
    cap = getattr(config, "final_logit_softcapping", None)
    return HeadTransform(scale, float(cap) if cap else None)


def unverified_transform(config) -> str | None:
    """The logit-transform setting of a family whose transform is not verified here, or None."""
    if getattr(config, "model_type", "") in HEAD_TRANSFORM_FAMILIES:
        return None
    set_keys = [k for k in NEUTRAL if getattr(config, k, None) not in (None, 1.0)]
    return set_keys[0] if set_keys else None


@contextmanager
def untransformed_head_output(model: torch.nn.Module):
    """Within the block the model's forward returns its LM head's output as it is: the chunked path's head
    returns log-probs, which the family's transform (applied after the head) must not touch. The settings
    the forward reads, on the model or its configuration, are neutral until the block ends."""
    saved = []
    if getattr(model.config, "model_type", "") not in SCALES_THE_HEAD_INPUT:
        for owner in (model, model.config):
            for key, neutral in NEUTRAL.items():
                value = vars(owner).get(key)
                if isinstance(value, (int, float)) and value != neutral:
                    saved.append((owner, key, value))
                    setattr(owner, key, neutral)
    try:
        yield
    finally:
        for owner, key, value in saved:
            setattr(owner, key, value)


class PolicyHead(torch.nn.Module):
    """The policy's output embedding followed by its family's transform: the logits its forward returns,
    from the LM head's inputs (THR reads π_old this way)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.head = model.get_output_embeddings()
        self.transform = head_transform(model.config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transform(self.head(hidden))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the LM-head product: autocast's when it is on (as the model's own head would run),
    else the promotion of the two. The backward recomputes the product in the same dtype, outside autocast."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, transform: HeadTransform, temperature: float):
    """(z / T in fp32 [c, V], tanh(scale · raw / softcap) when soft-capped, for the backward's derivative)."""
    z = (h @ w.T).float()
    if transform.scale != 1.0:
        z.mul_(transform.scale)
    capped = None
    if transform.softcap is not None:
        capped = z.div_(transform.softcap).tanh_()
        z = capped * transform.softcap
    return z.div_(temperature), capped


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int, with_entropy: bool, transform):
        M = hidden.shape[0]
        dtype = _compute_dtype(hidden, weight)
        h_c, w_c = hidden.to(dtype), weight.to(dtype)
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        # (a label for the profiler: `make gpu-check` reports the head's share of a step; microseconds otherwise)
        with torch.autocast(hidden.device.type, enabled=False), record_function("chunked LM head forward"):
            for s in range(0, M, chunk_tokens):
                e = min(M, s + chunk_tokens)
                # One [c, V] fp32 buffer per chunk (two when soft-capped), everything after the product in place
                # (logsumexp and the entropy's exp would each allocate another): with m = max z, u = exp(z − m),
                # S = Σu:   lse = m + log S,   H = −Σ p log p = log S − Σ u (z − m) / S,   u (z − m) = xlogy(u, u).
                z, capped = _chunk_logits(h_c[s:e], w_c, transform, temperature)  # [c, V]
                del capped
                z_y = z.gather(-1, targets[s:e, None]).squeeze(-1)
                m = z.amax(-1)
                u = z.sub_(m[:, None]).exp_()
                log_sum = u.sum(-1).log_()
                lse[s:e] = m + log_sum
                logp[s:e] = z_y - lse[s:e]
                if with_entropy:
                    entropy[s:e] = log_sum - u.xlogy_(u).sum(-1) / log_sum.exp()
                del z, u
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype, ctx.transform = temperature, chunk_tokens, dtype, transform
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, chunk, transform = ctx.temperature, ctx.chunk_tokens, ctx.transform
        h_c, w_c = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulated over chunks in fp32 even for bf16 weights (one [V, d] buffer during the backward).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False), record_function("chunked LM head backward"):
            for s in range(0, hidden.shape[0], chunk):
                e = min(hidden.shape[0], s + chunk)
                g = grad_logp[s:e].float()
                z, capped = _chunk_logits(h_c[s:e], w_c, transform, T)
                dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])  # −softmax(z) · g, in place of z
                dz.scatter_add_(-1, targets[s:e, None], g[:, None])  # + onehot(y) · g
                dz.div_(T).mul_(transform.scale)  # back through z = transform(raw) / T ...
                if capped is not None:
                    dz.mul_(capped.square_().neg_().add_(1))  # ... and the cap's tanh: 1 − tanh²
                del capped
                dz = dz.to(ctx.dtype)
                if need_h:
                    grad_h[s:e] = (dz @ w_c).to(hidden.dtype)
                if need_w:
                    if dz.dtype == torch.float32 and h_c.dtype == torch.float32:
                        grad_w.addmm_(dz.T, h_c[s:e])
                    else:  # the bf16 product added in place: no fp32 copy of a [V, d] product beside the accumulator
                        grad_w.add_(dz.T @ h_c[s:e])
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = False,
    transform: HeadTransform = HeadTransform(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(f(h Wᵀ) / T)[y] [M] in fp32 (differentiable in h and W), and the entropy [M] of
    softmax(f(h Wᵀ) / T) if asked (no grad), for hidden states `hidden` [M, d], LM-head weight [V, d],
    targets [M] and the family's head transform f; never more than `chunk_tokens` rows of logits exist at once."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    logp, entropy = _ChunkedTokenLogprobs.apply(
        hidden, weight, targets, temperature, chunk_tokens, with_entropy, transform
    )
    return logp, (entropy if with_entropy else None)


def supports_chunked_head(model: torch.nn.Module) -> str | None:
    """Why the chunked path cannot stand in for this model's LM head, or None when it can: it computes
    `transform(hidden @ weight.T)` (`head_transform`), so a head with a bias, or a logit transform the
    family's configuration does not describe, is left to the model's own forward."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"the output embedding is a {type(head).__name__}, not a Linear layer"
    if head.bias is not None:
        return "the LM head has a bias"
    if not isinstance(getattr(model, "logit_scale", 1.0), (int, float)):
        return "the model scales its logits by a learned parameter"
    key = unverified_transform(getattr(model, "config", None))
    if key is not None:
        return f"its configuration sets {key}, a logit transform not verified for model type {model.config.model_type!r}"
    return None
