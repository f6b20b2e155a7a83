"""Small tensor helpers shared by the pieces, the forward and the attribution methods."""

from __future__ import annotations

import math

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


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − eˣ) for x ≤ 0, accurate at both ends (Mächler's switch at −log 2)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) ‖ Bernoulli(q)) from log p and log q: a sampled token's probability under two policies
    read as the two-outcome distribution (the token, everything else). Exact at the edges, where a clamp of p
    and q would understate it: a term of weight 0 is 0, and mass where the other side has none is +inf."""
    p = logp.exp()
    token = torch.where(p > 0, p * (logp - logq), 0.0)
    log_rest_p, log_rest_q = log1mexp(logp), log1mexp(logq)
    rest = torch.where(log_rest_p > -math.inf, (1 - p) * (log_rest_p - log_rest_q), 0.0)
    return token + rest
