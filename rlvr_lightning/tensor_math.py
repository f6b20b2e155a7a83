"""Small tensor helpers shared by the pieces, the forward and the attribution methods."""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # as verl: exp() of a larger log-ratio is never a meaningful ratio


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def log_softmax_at(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) in fp32: the log-probs of the distribution the engine sampled from."""
    return (logits.float() / temperature).log_softmax(-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy −Σ p·log p along the last axis, from the full log-probs of `log_softmax_at`."""
    return -(logp.exp() * logp).sum(-1)
