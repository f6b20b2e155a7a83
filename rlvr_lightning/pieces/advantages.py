"""Advantage estimators (registered) and the group statistics of rewards they and the step use
(docs/algorithms.md#group-relative-advantages). Pure tensor functions."""

from __future__ import annotations

import math

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


@advantage_estimators.register("maxrl", anchor="maxrl")
def maxrl_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """MaxRL: the group-centred reward over the group's mean, (r − r̄)/r̄; 0 for a group whose mean is ≤ 0 (no
    success: no signal). With binary rewards and K of G correct, a success gets G/K − 1, a failure −1."""
    R = inputs.rewards.view(-1, inputs.group_size).float()
    mean = R.mean(1, keepdim=True)
    A = torch.where(mean > 0, (R - mean) / mean.clamp(min=torch.finfo(R.dtype).tiny), torch.zeros_like(R))
    return A.view(-1)


@advantage_estimators.register("rloo", anchor="rloo")
def rloo_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """RLOO: r_j minus the mean of the group's other G−1 rewards, = G/(G−1)·(r_j − mean)."""
    G = inputs.group_size
    return group_advantage(inputs.rewards, G, use_std=False) * (G / (G - 1))


@advantage_estimators.register("reinforce-pp", anchor="reinforce-baseline")
def reinforce_pp_advantage(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++-baseline: r − the group's mean, then whitened over the batch's response tokens (all ranks).

    Token-weighted: with Ã_n = r_n − mean_g(r) on each of its L_n tokens, μ = Σ L_n Ã_n / Σ L_n and
    σ² = Σ L_n (Ã_n − μ)² / Σ L_n, so Â_n = (Ã_n − μ) / √(σ² + 1e-8).
    """
    centred = group_advantage(inputs.rewards, inputs.group_size, use_std=False).double()
    L = inputs.lengths.double() if inputs.lengths is not None else torch.ones_like(centred)
    sums = inputs.reduce_sum(torch.stack([L.sum(), (L * centred).sum(), (L * centred**2).sum()]))
    mean = sums[1] / sums[0]
    var = (sums[2] / sums[0] - mean**2).clamp(min=0)
    return ((centred - mean) / (var + 1e-8).sqrt()).float()


def check_pass_at_k(*, pass_at_k: int, group_size: int) -> None:
    if not 1 <= pass_at_k <= group_size:
        raise ValueError(f"pass_at_k must lie in [1, rollout.group_size={group_size}], got {pass_at_k}")


@advantage_estimators.register("pass-at-k", anchor="passk-advantages", check=check_pass_at_k)
def pass_at_k_advantage(inputs: AdvantageInputs, *, pass_at_k: int = 4) -> torch.Tensor:
    """Pass@k training: the analytical advantage of each rollout for the group's pass@k reward.

    With n of the G rollouts incorrect: R̄ = 1 − C(n, k)/C(G, k), σ = √(R̄(1−R̄)); a correct rollout gets
    (1 − R̄)/σ, an incorrect one (1 − R̄ − C(n−1, k−1)/C(G−1, k−1))/σ; all-equal groups get 0.
    """
    G, k = inputs.group_size, pass_at_k
    wrong = inputs.correct.view(-1, G).lt(0.5).sum(1).double()  # n per group
    mean = 1 - comb(wrong, k) / math.comb(G, k)
    std = (mean * (1 - mean)).sqrt()
    # P(a given incorrect rollout is in a k-subset that is all incorrect) = C(n−1, k−1)/C(G−1, k−1).
    incorrect_share = comb(wrong - 1, k - 1) / math.comb(G - 1, k - 1)
    pos, neg = (1 - mean) / std, (1 - mean - incorrect_share) / std
    correct = inputs.correct.view(-1, G) > 0.5
    adv = torch.where(correct, pos[:, None], neg[:, None])
    return torch.where(std[:, None] > 0, adv, torch.zeros_like(adv)).float().view(-1)


def comb(n: torch.Tensor, k: int) -> torch.Tensor:
    """C(n, k) elementwise for a tensor n of counts (0 where n < k), in float64."""
    out = torch.ones_like(n)
    for i in range(k):
        out = out * (n - i) / (i + 1)
    return torch.where(n >= k, out, torch.zeros_like(out))


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


def advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    """The sequence advantages' mean, std, largest magnitude and share of exact zeros (groups without signal)."""
    a = advantages.detach().float()
    return {
        "adv_mean": a.mean().item(),
        "adv_std": a.std().item() if a.numel() > 1 else 0.0,
        "adv_abs_max": a.abs().max().item(),
        "adv_zero_frac": (a == 0).float().mean().item(),
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
