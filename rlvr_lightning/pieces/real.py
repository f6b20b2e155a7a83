"""REAL's group-level policy losses: rewards as class labels (arXiv 2602.05630; docs/algorithms.md#real).

Sequence-level losses on the logits s̄_n/τ (s̄ = `sequence_log_ratio`). They couple the rollouts of a
group, so they take whole groups' s̄ and correctness and divide by a global count of the optimizer
step (their `normaliser` trait): B = prompts (anchor, pairwise) or M = rollouts in mixed groups (BCE).
Each has a closed-form ∂L/∂s̄ (`grad_weights`) for the two-pass method and for logging.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlvr_lightning.pieces.kinds import GroupLossInputs, policy_losses

RealVariant = Literal["anchor", "bce", "pairwise"]


def _classes(s_bar: Tensor, correct: Tensor, group_size: int, tau: float):
    S = (s_bar.float() / tau).view(-1, group_size)
    pos = correct.view(-1, group_size) > 0.5
    neg = ~pos
    mixed = pos.any(1) & neg.any(1)
    return S, pos, neg, mixed


def _with_anchor(logits: Tensor, keep: Tensor) -> Tensor:
    """[g, G+1]: the logits of one class with the others at −inf, and the anchor logit 0 appended."""
    return torch.cat([logits.masked_fill(~keep, float("-inf")), logits.new_zeros(logits.shape[0], 1)], 1)


def real_loss(
    s_bar: Tensor,
    correct: Tensor,
    group_size: int,
    normaliser: float,
    tau: float = 0.5,
    variant: RealVariant = "anchor",
    world_size: int = 1,
) -> Tensor:
    """REAL's loss of whole groups, in fp32, divided by the step's global `normaliser` (× world_size).

    anchor:   L_g = log(1 + Σ_{O+} e^{−s̄/τ}) + log(1 + Σ_{O−} e^{s̄/τ})         (normaliser B)
    bce:      Σ_{k in mixed groups} BCEWithLogits(s̄_k/τ, c_k)                   (normaliser M)
    pairwise: L_g = log(1 + Σ_{i∈O+} Σ_{j∈O−} e^{(s̄_j − s̄_i)/τ})                (normaliser B)
    Only mixed groups contribute; the others still count in B. Without any mixed group the result
    is 0·Σs̄, which keeps the autograd graph (and any collective on it) alive.
    """
    S, pos, neg, mixed = _classes(s_bar, correct, group_size, tau)
    if variant == "anchor":
        per_group = torch.logsumexp(_with_anchor(-S, pos), 1) + torch.logsumexp(_with_anchor(S, neg), 1)
    elif variant == "pairwise":
        lse_neg = torch.logsumexp(S.masked_fill(~neg, float("-inf")), 1)
        lse_pos = torch.logsumexp((-S).masked_fill(~pos, float("-inf")), 1)
        per_group = torch.nn.functional.softplus(torch.where(mixed, lse_neg + lse_pos, torch.zeros_like(lse_neg)))
    elif variant == "bce":
        per_seq = torch.nn.functional.binary_cross_entropy_with_logits(S, pos.float(), reduction="none")
        per_group = per_seq.sum(1)
    else:
        raise ValueError(f"unknown REAL variant {variant!r}; valid: anchor, bce, pairwise")
    per_group = torch.where(mixed, per_group, torch.zeros_like(per_group))
    return (per_group.sum() + 0.0 * s_bar.sum()) / normaliser * world_size


@torch.no_grad()
def real_grad_weights(
    s_bar: Tensor, correct: Tensor, group_size: int, normaliser: float, tau: float = 0.5, variant: RealVariant = "anchor"
) -> Tensor:
    """Closed-form ∂L_step/∂s̄_k [N] (docs/algorithms.md#real-gradient-weights).

    anchor: W_k = −softmax([−S_{O+}, 0])_k/τ for positives, +softmax([S_{O−}, 0])_k/τ for negatives;
    bce: (σ(s̄_k/τ) − c_k)/τ; pairwise: ±softmax over the pair logits. Then / normaliser; 0 outside mixed groups.
    """
    S, pos, neg, mixed = _classes(s_bar, correct, group_size, tau)
    G = group_size
    if variant == "anchor":
        W = -torch.softmax(_with_anchor(-S, pos), 1)[:, :G] * pos + torch.softmax(_with_anchor(S, neg), 1)[:, :G] * neg
    elif variant == "bce":
        W = torch.sigmoid(S) - pos.float()
    elif variant == "pairwise":
        # L = softplus(x), x = lse_{O−}(S) + lse_{O+}(−S): ∂L/∂S_j = σ(x)·softmax_{O−}(S)_j, ∂L/∂S_i = −σ(x)·softmax_{O+}(−S)_i
        lse_neg = torch.logsumexp(S.masked_fill(~neg, float("-inf")), 1, keepdim=True)
        lse_pos = torch.logsumexp((-S).masked_fill(~pos, float("-inf")), 1, keepdim=True)
        gate = torch.sigmoid(torch.where(mixed[:, None], lse_neg + lse_pos, torch.zeros_like(lse_neg)))
        W = gate * (
            torch.softmax(S.masked_fill(~neg, float("-inf")), 1).nan_to_num(0.0) * neg
            - torch.softmax((-S).masked_fill(~pos, float("-inf")), 1).nan_to_num(0.0) * pos
        )
    else:
        raise ValueError(f"unknown REAL variant {variant!r}; valid: anchor, bce, pairwise")
    return (W / tau * mixed[:, None]).reshape(-1) / normaliser


def check_tau(*, tau: float) -> None:
    """τ scales the sequence logits s̄/τ (and bounds each sequence's gradient by 1/τ)."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")


def _register(variant: RealVariant, name: str, anchor: str, normaliser: str, summary: str) -> None:
    def loss(x: GroupLossInputs, *, tau: float = 0.5) -> Tensor:
        return real_loss(x.s_bar, x.correct, x.group_size, x.normaliser, tau, variant, x.world_size)

    def grad_weights(x: GroupLossInputs, *, tau: float = 0.5) -> Tensor:
        return real_grad_weights(x.s_bar, x.correct, x.group_size, x.normaliser, tau, variant)

    loss.__name__ = loss.__qualname__ = name.replace("-", "_")
    loss.__doc__ = summary
    policy_losses.register(
        name, anchor=anchor, check=check_tau, level="group", token_advantages=False, normaliser=normaliser,
        grad_weights=grad_weights,
    )(loss)
    globals()[loss.__name__] = loss  # importable by dotted path like any piece


_register("anchor", "real-anchor", "real", "groups", "REAL: anchor-logit classification of each group's correct vs incorrect rollouts.")
_register("bce", "real-bce", "real-bce-and-pairwise-variants", "mixed_sequences", "REAL-BCE: independent BCE-with-logits on s̄/τ per rollout of mixed groups.")
_register("pairwise", "real-pairwise", "real-bce-and-pairwise-variants", "groups", "REAL pairwise: anchor-free ranking of every correct over every incorrect rollout.")
