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


def binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) ‖ Bernoulli(q)), p and q kept inside (0, 1): a sampled token's probability under two
    policies read as the two-outcome distribution (the token, everything else)."""
    p, q = p.clamp(1e-8, 1 - 1e-8), q.clamp(1e-8, 1 - 1e-8)
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
