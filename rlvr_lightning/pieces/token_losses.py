"""Token-level policy losses (docs/algorithms.md#shared-pieces): each returns the per-token loss
[n, T], reduced afterwards by the loss aggregator, and detached per-token statistics (the ratio and
boolean clip masks) that the update logs as token-weighted means."""

from __future__ import annotations

import torch
from torch import Tensor

from rlvr_lightning.pieces.kinds import TokenLossInputs, policy_losses
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP

GSPO_LOG_RATIO_MAX = 10.0  # as verl's GSPO: the sequence log-ratio is clamped above before exp()
LossAndStats = tuple[Tensor, dict[str, Tensor]]


def clipped_objective(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> LossAndStats:
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


def check_ratio_band(*, clip_eps_low: float, clip_eps_high: float) -> None:
    """The clip range [1−ε_low, 1+ε_high] of the ratio: ε_low = 1 leaves no lower bound (CISPO)."""
    if not (0 <= clip_eps_low <= 1 and clip_eps_high >= 0):
        raise ValueError(f"the ratio's clip range needs 0 ≤ clip_eps_low ≤ 1 and clip_eps_high ≥ 0, got {clip_eps_low}, {clip_eps_high}")


def check_log_band(*, clip_eps_low: float, clip_eps_high: float) -> None:
    """GMPO's clip range [−ε_low, ε_high] of the token log-ratio: any non-negative widths."""
    if not (clip_eps_low >= 0 and clip_eps_high >= 0):
        raise ValueError(f"the log-ratio's clip range [−clip_eps_low, clip_eps_high] needs both ≥ 0, got {clip_eps_low}, {clip_eps_high}")


def check_sapo_temperatures(*, sapo_tau_pos: float, sapo_tau_neg: float) -> None:
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"the gate's temperatures must be > 0, got sapo_tau_pos={sapo_tau_pos}, sapo_tau_neg={sapo_tau_neg}")


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """s̄_n = (1/L_n) Σ_t mask·(logp − old_logp): the length-normalised log-ratio of each sequence."""
    return ((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)


@policy_losses.register("ppo-clip", anchor="ppo-clipped-surrogate", check=check_ratio_band)
def ppo_clip(x: TokenLossInputs, *, clip_eps_low: float, clip_eps_high: float) -> LossAndStats:
    """PPO's clipped surrogate with the per-token ratio π_θ/π_old (asymmetric ε = DAPO's clip-higher)."""
    ratio = (x.logp - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return clipped_objective(ratio, x.advantages, clip_eps_low, clip_eps_high)


@policy_losses.register("gspo-token", anchor="gspo-and-gspo-token", check=check_ratio_band)
def gspo_token(x: TokenLossInputs, *, clip_eps_low: float, clip_eps_high: float) -> LossAndStats:
    """GSPO-token: value s_n = exp(s̄_n), gradient through token t only; accepts reshaped token advantages.

    s_{n,t} = sg[s_n]·π_θ(y_t)/sg[π_θ(y_t)]. With per-sequence advantages its gradient equals GSPO's.
    """
    seq_lr = sequence_log_ratio(x.logp, x.old_logp, x.mask).detach()
    log_s = ((x.logp - x.logp.detach()) + seq_lr[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    return clipped_objective(log_s.exp(), x.advantages, clip_eps_low, clip_eps_high)


@policy_losses.register("gspo", anchor="gspo-and-gspo-token", check=check_ratio_band, token_advantages=False, token_weights=False)
def gspo(x: TokenLossInputs, *, clip_eps_low: float, clip_eps_high: float) -> LossAndStats:
    """GSPO: one clipped term per sequence with the length-normalised sequence ratio s_n = exp(s̄_n).

    The sequence term is written on every response token so that `seq-mean-token-mean` reduces it
    to (1/N)Σ_n term_n, the paper's objective. Token advantages are averaged over the sequence
    (identical to Â_n when they were not reshaped).
    """
    s = sequence_log_ratio(x.logp, x.old_logp, x.mask).clamp(max=GSPO_LOG_RATIO_MAX).exp()
    seq_adv = (x.advantages * x.mask).sum(1) / x.mask.sum(1).clamp(min=1)
    per_seq, stats = clipped_objective(s, seq_adv, clip_eps_low, clip_eps_high)
    return per_seq[:, None] * x.mask, {k: v[:, None].expand_as(x.mask) for k, v in stats.items()}


@policy_losses.register("cispo", anchor="cispo", check=check_ratio_band)
def cispo(x: TokenLossInputs, *, clip_eps_low: float, clip_eps_high: float) -> LossAndStats:
    """CISPO: REINFORCE on every token, weighted by the clipped, stop-gradient importance ratio.

    −sg[clip(r, 1−ε_low, 1+ε_high)]·Â·log π_θ: unlike PPO's clip no token loses its gradient; the
    band bounds the weight only (ε_low = 1: no lower bound, as in the paper).
    """
    ratio = (x.logp.detach() - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    stats = {"ratio": ratio, "clipped_low": ratio < 1 - clip_eps_low, "clipped_high": ratio > 1 + clip_eps_high}
    return -weight * x.advantages * x.logp, stats


@policy_losses.register("gmpo", anchor="gmpo", check=check_log_band, token_advantages=False, token_weights=False)
def gmpo(x: TokenLossInputs, *, clip_eps_low: float, clip_eps_high: float) -> LossAndStats:
    """GMPO: the geometric mean of the token ratios, each clipped in log space to [−ε_low, ε_high] on the
    side the sequence advantage pushes (above for Â > 0, below for Â < 0); one term per sequence."""
    log_ratio = (x.logp - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * x.mask
    seq_adv = (x.advantages * x.mask).sum(1) / x.mask.sum(1).clamp(min=1)
    sign = seq_adv.sign()[:, None]
    kept = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-clip_eps_low, clip_eps_high))
    geometric_mean = ((kept * x.mask).sum(1) / x.mask.sum(1).clamp(min=1)).exp()
    with torch.no_grad():
        stats = {
            "ratio": log_ratio.exp(),
            "clipped_low": (sign < 0) & (log_ratio < -clip_eps_low),
            "clipped_high": (sign > 0) & (log_ratio > clip_eps_high),
        }
    return (-seq_adv * geometric_mean)[:, None] * x.mask, stats


@policy_losses.register("sapo", anchor="sapo", check=check_sapo_temperatures)
def sapo(x: TokenLossInputs, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05) -> LossAndStats:
    """SAPO: a soft gate f(r) = (4/τ)·σ(τ(r − 1)) in place of the hard clip, −f(r)·Â per token; τ_pos for
    Â > 0, τ_neg otherwise. Its gradient weight 4σ(1−σ)·r is 1 on policy and fades smoothly off it."""
    ratio = (x.logp - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    tau = torch.where(x.advantages > 0, sapo_tau_pos, sapo_tau_neg)
    gate = 4 / tau * torch.sigmoid(tau * (ratio - 1))
    none = torch.zeros_like(x.mask, dtype=torch.bool)
    return -gate * x.advantages, {"ratio": ratio.detach(), "clipped_low": none, "clipped_high": none}
