"""Policy-loss building blocks (docs/algorithms.md#shared-pieces). Pure tensor functions.

Shapes: per-token tensors are [N, T] over response positions; `mask` is 1 on response tokens.
Padded positions of every log-prob tensor hold 0, so `x * mask` never produces NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Surrogate = Literal["ppo-clip", "gspo-token", "gspo"]
TISLevel = Literal["off", "token", "sequence"]
LOG_RATIO_CLAMP = 20.0  # as verl: exp() of a larger log-ratio is never a meaningful ratio
GSPO_LOG_RATIO_MAX = 10.0  # as verl's GSPO: the sequence log-ratio is clamped above before exp()

# Every policy surrogate has one calling convention, so a preset is a choice of pieces:
#   surrogate(logp, old_logp, adv, mask, eps_low, eps_high) -> (per_token_loss [N,T], stats)
# `adv` holds token advantages Â_{n,t} (sequence advantages broadcast, possibly reshaped by THR/OAR);
# `stats` holds detached per-token tensors: the ratio and boolean clip masks.


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """−min(ratio·Â, clip(ratio, 1−ε_low, 1+ε_high)·Â) and which tokens the clip silenced."""
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


def ppo_clip(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float = 0.2, eps_high: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's per-token clipped surrogate with ρ = π_θ/π_old per token (docs/algorithms.md#ppo-clipped-surrogate; asymmetric ε = clip-higher)."""
    ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return _clipped_objective(ratio, adv, eps_low, eps_high)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s̄_n = (1/L_n) Σ_t mask·(logp − old_logp): the length-normalised log-ratio of each sequence."""
    return ((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)


def gspo_token(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float = 3e-4, eps_high: float = 4e-4
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (docs/algorithms.md#gspo-and-gspo-token): s_{n,t} = sg[s_n]·π_θ(y_t)/sg[π_θ(y_t)], value s_n, gradient through token t only.

    With per-sequence advantages its gradient equals sequence-level GSPO's; unlike GSPO it accepts
    token advantages reshaped by THR/OAR.
    """
    seq_lr = sequence_log_ratio(logp, old_logp, mask).detach()
    log_s = ((logp - logp.detach()) + seq_lr[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    return _clipped_objective(log_s.exp(), adv, eps_low, eps_high)


def gspo(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps_low: float = 3e-4, eps_high: float = 4e-4
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level GSPO (docs/algorithms.md#gspo-and-gspo-token): one clipped term per sequence with s_n = exp(s̄_n).

    The sequence term is written on every response token so that `seq-mean-token-mean` reduces it
    to (1/N)Σ_n term_n, the paper's objective. Token advantages are averaged over the sequence
    (identical to Â_n when they were not reshaped).
    """
    s = sequence_log_ratio(logp, old_logp, mask).clamp(max=GSPO_LOG_RATIO_MAX).exp()
    seq_adv = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    per_seq, stats = _clipped_objective(s, seq_adv, eps_low, eps_high)
    return per_seq[:, None] * mask, {k: v[:, None].expand_as(mask) for k, v in stats.items()}


SURROGATES = {"ppo-clip": ppo_clip, "gspo-token": gspo_token, "gspo": gspo}


def truncated_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: TISLevel, cap: float
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance-sampling weights that correct for the engine ≠ trainer mismatch.

    The engine samples from π_rollout, while the loss's ratio is taken against π_old as the trainer
    computes it; w = min(π_old/π_rollout, cap) re-weights the policy-gradient term (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; verl's `tis_imp_ratio_cap`).
    `token`: one weight per token; `sequence`: the product over the sequence, shared by its tokens.
    Returns detached weights [N,T] (None when `level` is `off`) and statistics.
    """
    if level == "off":
        return None, {}
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown truncated-IS level {level!r}; valid: off, token, sequence")
    with torch.no_grad():
        log_w = (old_logp - rollout_logp) * mask
        if level == "sequence":
            log_w = log_w.sum(1, keepdim=True).expand_as(mask)
        raw = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weights = raw.clamp(max=cap) * mask
        stats = {
            "tis_weight_mean": masked_mean(weights, mask).item(),
            "tis_capped_frac": masked_mean((raw > cap).float(), mask).item(),
        }
    return weights, stats


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


def log_softmax_at(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) in fp32: the log-probs of the distribution the engine sampled from."""
    return (logits.float() / temperature).log_softmax(-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy −Σ p·log p along the last axis, from the full log-probs of `log_softmax_at`."""
    return -(logp.exp() * logp).sum(-1)


# ---- REAL: rewards as class labels (arXiv 2602.05630; docs/algorithms.md#real) ----------
# Sequence-level losses on the logits s̄_n/τ (s̄ = sequence_log_ratio). They couple the rollouts of a
# group, so they take the whole group's s̄ and correctness, and divide by a global count given by
# the caller: B = prompts of the optimizer step (anchor, pairwise) or M = rollouts in mixed groups (BCE).
RealVariant = Literal["anchor", "bce", "pairwise"]


def _classes(s_bar: torch.Tensor, correct: torch.Tensor, group_size: int, tau: float):
    S = (s_bar.float() / tau).view(-1, group_size)
    pos = correct.view(-1, group_size) > 0.5
    neg = ~pos
    mixed = pos.any(1) & neg.any(1)
    return S, pos, neg, mixed


def _with_anchor(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[g, G+1]: the logits of one class with the others at −inf, and the anchor logit 0 appended."""
    return torch.cat([logits.masked_fill(~keep, float("-inf")), logits.new_zeros(logits.shape[0], 1)], 1)


def real_loss(
    s_bar: Tensor, correct: Tensor, group_size: int, normaliser: float, tau: float = 0.5,
    variant: RealVariant = "anchor", world_size: int = 1,
) -> Tensor:  # fmt: skip
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
    """Closed-form ∂L_step/∂s̄_k [N] (docs/algorithms.md#real-gradient-weights), for the two-pass method and for logging.

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
        W = gate * (torch.softmax(S.masked_fill(~neg, float("-inf")), 1).nan_to_num(0.0) * neg
                    - torch.softmax((-S).masked_fill(~pos, float("-inf")), 1).nan_to_num(0.0) * pos)  # fmt: skip
    else:
        raise ValueError(f"unknown REAL variant {variant!r}; valid: anchor, bce, pairwise")
    return (W / tau * mixed[:, None]).reshape(-1) / normaliser
