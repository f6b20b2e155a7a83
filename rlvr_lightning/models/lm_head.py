"""Log-probs of the sampled tokens straight from the LM head's inputs, chunk by chunk.

Why not `log_softmax(model(...).logits)`: at a 151,936-token vocabulary the logits of one micro-batch
of 8 × 4k response tokens are ~20 GB in fp32, and autograd keeps them, their log-softmax and the
entropy's exp for the backward. Here the LM head runs over at most `chunk_tokens` tokens at a time;
the forward keeps only each token's log-sum-exp, and the backward recomputes the chunk's logits:

    z = h Wᵀ / T,   log π(y) = z_y − lse(z),   ∂log π(y)/∂z = onehot(y) − softmax(z)
    ∂/∂h = (∂/∂z) W / T,   ∂/∂W = (∂/∂z)ᵀ h / T

so memory is O(chunk_tokens × V) in both passes, for one extra LM-head product in the backward.
Fused kernels (Liger's fused linear cross-entropy) compute the gradient inside the forward for a
scalar loss; our losses need the per-token log-probs themselves with any upstream gradient, which is
what this function provides on every device.
"""

from __future__ import annotations

import torch


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int, with_entropy: bool):
        M = hidden.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, M, chunk_tokens):
            e = min(M, s + chunk_tokens)
            # One [c, V] fp32 buffer per chunk, everything after the product in place (logsumexp and
            # the entropy's exp would each allocate another): with m = max z, u = exp(z − m), S = Σu,
            #   lse = m + log S,   H = −Σ p log p = log S − Σ u (z − m) / S,   u (z − m) = xlogy(u, u).
            z = (hidden[s:e] @ weight.T).float().div_(temperature)  # [c, V]
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
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk_tokens
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulated over chunks in fp32 even for bf16 weights (one [V, d] buffer during the backward).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            e = min(hidden.shape[0], s + chunk)
            g = grad_logp[s:e].float()
            z = (hidden[s:e] @ weight.T).float().div_(T)
            dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])  # −softmax(z) · g, in place of z
            dz.scatter_add_(-1, targets[s:e, None], g[:, None])  # + onehot(y) · g
            dz = dz.div_(T).to(weight.dtype)
            if need_h:
                grad_h[s:e] = dz @ weight
            if need_w:
                if dz.dtype == torch.float32:
                    grad_w.addmm_(dz.T, hidden[s:e])
                else:
                    grad_w += (dz.T @ hidden[s:e]).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h Wᵀ / T)[y] [M] in fp32 (differentiable in h and W), and the entropy [M] of
    softmax(h Wᵀ / T) if asked (no grad), for hidden states `hidden` [M, d], LM-head weight [V, d] and
    targets [M]; never more than `chunk_tokens` rows of logits exist at once."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    logp, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, with_entropy)
    return logp, (entropy if with_entropy else None)


def supports_chunked_head(model: torch.nn.Module) -> str | None:
    """Why the chunked path cannot stand in for this model's LM head, or None when it can: it computes
    exactly `hidden @ weight.T`, so a head with a bias, logit soft-capping or a logit scale is left to
    the model's own forward."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"the output embedding is a {type(head).__name__}, not a Linear layer"
    if head.bias is not None:
        return "the LM head has a bias"
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the model soft-caps its logits"
    if getattr(model, "logit_scale", None) is not None or getattr(config, "logit_scale", None) not in (None, 1.0):
        return "the model scales its logits"
    return None
