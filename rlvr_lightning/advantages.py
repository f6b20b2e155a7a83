"""Group statistics of rewards (ALGORITHMS.md §1.1). Pure tensor functions."""

from __future__ import annotations

import torch


def group_advantage(r: torch.Tensor, group_size: int, use_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage Â_j = (r_j − μ_b) / (σ_b + ε) with the unbiased (G−1) std, or r_j − μ_b.

    `r` is [B·G], stored group-contiguously. All-equal groups get exactly 0, not a value that
    depends on floating-point cancellation.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be ≥ 2 for group-relative advantages, got {group_size}")
    R = r.view(-1, group_size).float()
    A = R - R.mean(1, keepdim=True)
    if use_std:
        A = A / (R.std(1, unbiased=True, keepdim=True) + eps)
    all_equal = R.max(1).values == R.min(1).values
    A = torch.where(all_equal[:, None], torch.zeros_like(A), A)
    return A.view(-1)


def group_reward_stats(r: torch.Tensor, group_size: int) -> dict[str, float]:
    """Reward metrics named as in verl/TRL."""
    R = r.view(-1, group_size).float()
    zero_std = (R.max(1).values == R.min(1).values).float()
    return {
        "reward_mean": R.mean().item(),
        "reward_std": R.std().item() if R.numel() > 1 else 0.0,
        "frac_reward_zero_std": zero_std.mean().item(),
    }
