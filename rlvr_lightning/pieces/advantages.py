"""Advantage estimators (registered) and the group statistics of rewards they and the step use
(docs/algorithms.md#group-relative-advantages). Pure tensor functions."""

from __future__ import annotations

import torch

from rlvr_lightning.pieces.kinds import AdvantageInputs, advantage_estimators


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


@advantage_estimators.register("grpo", anchor="group-relative-advantages")
def grpo_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """GRPO: the group-normalised reward (r − mean) / (std + ε), unbiased std; 0 for all-equal groups."""
    return group_advantage(inputs.rewards, inputs.group_size, use_std=True)


@advantage_estimators.register("dr-grpo", anchor="dr-grpo")
def dr_grpo_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """Dr. GRPO: the group-centred reward r − mean, unscaled (no difficulty bias)."""
    return group_advantage(inputs.rewards, inputs.group_size, use_std=False)


@advantage_estimators.register("none", anchor="real")
def no_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """No advantages (zeros): for losses that read the correctness labels themselves (REAL)."""
    return torch.zeros(inputs.rewards.shape[0])


def group_reward_stats(r: torch.Tensor, group_size: int) -> dict[str, float]:
    """Reward metrics named as in verl/TRL."""
    R = r.view(-1, group_size).float()
    zero_std = (R.max(1).values == R.min(1).values).float()
    return {
        "reward_mean": R.mean().item(),
        "reward_std": R.std().item() if R.numel() > 1 else 0.0,
        "frac_reward_zero_std": zero_std.mean().item(),
    }


def mixed_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] bool: groups with at least one correct and one incorrect rollout (0 < n+ < G).

    DAPO's dynamic-sampling filter. It looks at correctness c, never at a shaped reward: an
    all-correct group whose overlong penalties differ still carries no signal about correctness.
    """
    n_correct = correct.view(-1, group_size).gt(0.5).sum(1)
    return (n_correct > 0) & (n_correct < group_size)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int) -> torch.Tensor:
    """DAPO's soft overlong punishment R_length(L) ∈ [−1, 0] (docs/algorithms.md#overlong-reward-shaping-and-filtering).

    0 up to L_max − L_cache, then linear down to −1 at L_max, and −1 beyond.
    """
    if buffer_length <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    if buffer_length > max_length:
        raise ValueError(f"overlong buffer ({buffer_length}) exceeds the maximum length ({max_length})")
    start = max_length - buffer_length
    penalty = (start - lengths.float()) / buffer_length
    return penalty.clamp(min=-1.0, max=0.0)
