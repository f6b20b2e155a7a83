"""Policy-loss building blocks (ALGORITHMS.md §1.2–1.4). Pure tensor functions.

Shapes: per-token tensors are [N, T] over response positions; `mask` is 1 on response tokens.
Padded positions of every log-prob tensor hold 0, so `x * mask` never produces NaN.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
LOG_RATIO_CLAMP = 20.0  # as verl: exp() of a larger log-ratio is never a meaningful ratio


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate −min(ρÂ, clip(ρ, 1−ε_low, 1+ε_high)Â) and its clip masks."""
    ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_tok = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        # A token is "clipped" when the clipped branch is active and strictly larger (no gradient).
        active = clipped > unclipped
        stats = {
            "ratio": ratio.detach(),
            "clipped_low": active & (ratio < 1 - eps_low),
            "clipped_high": active & (ratio > 1 + eps_high),
        }
    return per_tok, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token KL(πθ‖π_ref) estimate (Schulman's k1/k2/k3). k3 is clamped as in verl."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (d.exp() - d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: k1, k2, k3")


def aggregate(
    per_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    num_seqs: float,
    num_tokens: float,
    norm_const: float | None = None,
    world_size: int = 1,
) -> torch.Tensor:
    """Reduce per-token losses of one micro-batch with the optimizer step's *global* normalisers.

    `num_seqs` (N_S) and `num_tokens` (T_S) count the whole optimizer step over all micro-batches
    and ranks, so the accumulated gradient does not depend on how the step is split. Multiplying
    by `world_size` undoes DDP/FSDP gradient averaging.
    """
    masked = per_tok * mask
    if mode == "seq-mean-token-mean":
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    elif mode == "token-mean":
        loss = masked.sum() / num_tokens
    elif mode == "seq-mean-token-sum-norm":
        if not norm_const:
            raise ValueError("seq-mean-token-sum-norm needs a constant normaliser (max_response_length)")
        loss = masked.sum() / (num_seqs * norm_const)
    else:
        raise ValueError(f"unknown loss_agg {mode!r}; valid: seq-mean-token-mean, token-mean, seq-mean-token-sum-norm")
    return loss * world_size


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Token entropy of softmax(logits) along the last axis, in fp32."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
