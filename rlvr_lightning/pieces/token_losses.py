"""Token-level policy losses (docs/algorithms.md#shared-pieces): each returns the per-token loss
[n, T], reduced afterwards by the loss aggregator, and detached per-token statistics (the ratio and
boolean clip masks) that the update logs as token-weighted means."""

from __future__ import annotations

import torch
from torch import Tensor

from rlvr_lightning.pieces.kinds import TokenLossInputs, policy_losses
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP, binary_kl

GSPO_LOG_RATIO_MAX = 10.0  # as verl's GSPO: the sequence log-ratio is clamped above before exp()
LossAndStats = tuple[Tensor, dict[str, Tensor]]


def clipped_objective(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip_c: float | None = None
) -> LossAndStats:
    """−min(ratio·Â, clip(ratio, 1−ε_low, 1+ε_high)·Â) and which tokens the clip silenced. `dual_clip_c` = c:
    where Â < 0 the loss is also capped at c·|Â| (dual-clip PPO), so a token whose ratio ran far above 1 on
    a negative advantage stops pushing its probability down (no gradient beyond ratio c)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_tok = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c
        dual = (adv < 0) & (per_tok > bound)
        per_tok = torch.where(adv < 0, torch.minimum(per_tok, bound), per_tok)
    with torch.no_grad():
        # A token is "clipped" when the clipped branch is active and strictly larger (no gradient).
        active = clipped > unclipped
        stats = {
            "ratio": ratio.detach(),
            "clipped_low": active & (ratio < 1 - eps_low),
            "clipped_high": active & (ratio > 1 + eps_high),
        }
        if dual_clip_c is not None:
            stats["clipped_dual"] = dual
    return per_tok, stats


def check_ratio_band(*, clip_eps_low: float, clip_eps_high: float) -> None:
    """The clip range [1−ε_low, 1+ε_high] of the ratio: ε_low = 1 leaves no lower bound (CISPO)."""
    if not (0 <= clip_eps_low <= 1 and clip_eps_high >= 0):
        raise ValueError(f"the ratio's clip range needs 0 ≤ clip_eps_low ≤ 1 and clip_eps_high ≥ 0, got {clip_eps_low}, {clip_eps_high}")


def check_dual_clip(*, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float | None = None) -> None:
    """The ratio band, and dual clip's c > 1 (at c ≤ 1 the cap would act inside the clip range)."""
    check_ratio_band(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c (dual-clip PPO's c) must be > 1, got {dual_clip_c}")


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


@policy_losses.register("ppo-clip", anchor="ppo-clipped-surrogate", check=check_dual_clip)
def ppo_clip(
    x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip_c: float | None = None
) -> LossAndStats:
    """PPO's clipped surrogate with the per-token ratio π_θ/π_old (asymmetric ε = DAPO's clip-higher;
    `dual_clip_c`: dual-clip PPO)."""
    ratio = (x.logp - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return clipped_objective(ratio, x.advantages, clip_eps_low, clip_eps_high, dual_clip_c)


@policy_losses.register("gspo-token", anchor="gspo-and-gspo-token", check=check_dual_clip)
def gspo_token(
    x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip_c: float | None = None
) -> LossAndStats:
    """GSPO-token: value s_n = exp(s̄_n), gradient through token t only; accepts reshaped token advantages.

    s_{n,t} = sg[s_n]·π_θ(y_t)/sg[π_θ(y_t)]. With per-sequence advantages its gradient equals GSPO's.
    """
    seq_lr = sequence_log_ratio(x.logp, x.old_logp, x.mask).detach()
    log_s = ((x.logp - x.logp.detach()) + seq_lr[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    return clipped_objective(log_s.exp(), x.advantages, clip_eps_low, clip_eps_high, dual_clip_c)


@policy_losses.register("gspo", anchor="gspo-and-gspo-token", check=check_dual_clip, token_advantages=False, token_weights=False)
def gspo(
    x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip_c: float | None = None
) -> LossAndStats:
    """GSPO: one clipped term per sequence with the length-normalised sequence ratio s_n = exp(s̄_n).

    The sequence term is written on every response token so that `seq-mean-token-mean` reduces it
    to (1/N)Σ_n term_n, the paper's objective. Token advantages are averaged over the sequence
    (identical to Â_n when they were not reshaped).
    """
    s = sequence_log_ratio(x.logp, x.old_logp, x.mask).clamp(max=GSPO_LOG_RATIO_MAX).exp()
    seq_adv = (x.advantages * x.mask).sum(1) / x.mask.sum(1).clamp(min=1)
    per_seq, stats = clipped_objective(s, seq_adv, clip_eps_low, clip_eps_high, dual_clip_c)
    return per_seq[:, None] * x.mask, {k: v[:, None].expand_as(x.mask) for k, v in stats.items()}


@policy_losses.register("cispo", anchor="cispo", check=check_ratio_band)
def cispo(x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2) -> LossAndStats:
    """CISPO: REINFORCE on every token, weighted by the clipped, stop-gradient importance ratio.

    −sg[clip(r, 1−ε_low, 1+ε_high)]·Â·log π_θ: unlike PPO's clip no token loses its gradient; the
    band bounds the weight only (ε_low = 1: no lower bound, as in the paper).
    """
    ratio = (x.logp.detach() - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    stats = {"ratio": ratio, "clipped_low": ratio < 1 - clip_eps_low, "clipped_high": ratio > 1 + clip_eps_high}
    return -weight * x.advantages * x.logp, stats


@policy_losses.register("gmpo", anchor="gmpo", check=check_log_band, token_advantages=False, token_weights=False)
def gmpo(x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2) -> LossAndStats:
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


def check_dppo(*, clip_eps_low: float, clip_eps_high: float, dppo_ratio_cap: float = 10.0) -> None:
    if not (clip_eps_low >= 0 and clip_eps_high >= 0 and dppo_ratio_cap > 0):
        raise ValueError(
            f"DPPO needs trust-region widths δ (clip_eps_low, clip_eps_high) ≥ 0 and dppo_ratio_cap > 0, "
            f"got {clip_eps_low}, {clip_eps_high}, {dppo_ratio_cap}"
        )


def trust_region_masked(x: TokenLossInputs, pushed_up: Tensor, pushed_down: Tensor, cap: float) -> LossAndStats:
    """DPPO's loss given which tokens left the trust region in the direction their advantage pushes: the
    rest get REINFORCE weighted by the stop-gradient ratio, capped at C: −Â·sg(min(r, C))·∇log π_θ (its value
    −Â·min(r, C)); a masked token gets no gradient but stays in the normaliser."""
    ratio = (x.logp.detach() - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    masked = ((x.advantages > 0) & pushed_up) | ((x.advantages <= 0) & pushed_down)
    weight = torch.where(masked, 0.0, ratio.clamp(max=cap))
    per_tok = -x.advantages * weight * (x.logp - x.logp.detach()).exp()
    return per_tok, {"ratio": ratio, "clipped_low": masked & (x.advantages <= 0), "clipped_high": masked & (x.advantages > 0)}


@policy_losses.register("dppo-tv", anchor="dppo-trust-region-masks", check=check_dppo)
def dppo_tv(x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dppo_ratio_cap: float = 10.0) -> LossAndStats:
    """DPPO's binary total-variation mask: with π, μ the current and old probabilities of the sampled token,
    a token with Â > 0 is masked when π − μ > δ_high, one with Â ≤ 0 when π − μ < −δ_low (δ = clip_eps_*)."""
    diff = x.logp.detach().exp() - x.old_logp.exp()
    return trust_region_masked(x, diff > clip_eps_high, diff < -clip_eps_low, dppo_ratio_cap)


@policy_losses.register("dppo-kl", anchor="dppo-trust-region-masks", check=check_dppo)
def dppo_kl(x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dppo_ratio_cap: float = 10.0) -> LossAndStats:
    """DPPO's binary KL mask: D = KL(Bernoulli(μ) ‖ Bernoulli(π)) of the sampled token; a token with Â > 0 is
    masked when D > δ_high and π > μ, one with Â ≤ 0 when D > δ_low and π < μ."""
    pi, mu = x.logp.detach().exp(), x.old_logp.exp()
    d = binary_kl(x.old_logp, x.logp.detach())
    return trust_region_masked(x, (d > clip_eps_high) & (pi > mu), (d > clip_eps_low) & (pi < mu), dppo_ratio_cap)


def check_dro_beta(*, dro_beta: float = 0.05) -> None:
    if not dro_beta > 0:
        raise ValueError(f"dro_beta (the quadratic penalty's β) must be > 0, got {dro_beta}")


@policy_losses.register("dro", anchor="dro", check=check_dro_beta)
def dro(x: TokenLossInputs, *, dro_beta: float = 0.05) -> LossAndStats:
    """DRO (verl's `dro`, after Richemond et al. 2024): −(Â·log π_θ − β/2·(log π_θ − log π_old)²) per token,
    no ratio and no clip; its gradient −Â + β·(log π_θ − log π_old) vanishes where the log-ratio reaches Â/β."""
    log_ratio = x.logp - x.old_logp
    none = torch.zeros_like(x.mask, dtype=torch.bool)
    ratio = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return -(x.advantages * x.logp - dro_beta / 2 * log_ratio**2), {"ratio": ratio, "clipped_low": none, "clipped_high": none}
