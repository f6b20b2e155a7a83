"""Rollout corrections (docs/algorithms.md#behaviour-policy-and-truncated-importance-sampling,
#masked-importance-sampling-and-icepop): weights on the policy term against the engine ≠ trainer
mismatch. The engine samples from π_rollout while the loss's ratio is taken against π_old as the
trainer computes it (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; Liu, Li et al. 2025, "When Speed Kills Stability"; verl's rollout correction).

Sequence ratios ρ(y) = Π_t ρ_t are kept as their logs, Σ_t log ρ_t: the product itself leaves float32
within a few thousand tokens (8,192 tokens at ρ_t = 1.02 is e^162)."""

from __future__ import annotations

import math

import torch

from rlvr_lightning.pieces.kinds import CorrectionInputs, rollout_corrections
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP, binary_kl, masked_mean

Weights = tuple[torch.Tensor | None, dict[str, float]]


def _token_log_ratio(x: CorrectionInputs) -> torch.Tensor:
    """log π_old/π_rollout per token [N, T], 0 off the mask (whatever padding holds, even ±inf)."""
    return torch.where(x.mask.bool(), x.old_logp - x.rollout_logp, 0.0)


def _sequence_log_ratio(x: CorrectionInputs) -> torch.Tensor:
    """log ρ(y) = Σ_t log ρ_t per sequence [N, 1]: the log of the sequence's importance ratio."""
    return _token_log_ratio(x).sum(1, keepdim=True)


@rollout_corrections.register("none", anchor="behaviour-policy-and-truncated-importance-sampling", level=None)
def no_correction(x: CorrectionInputs) -> Weights:
    """No correction: the trainer's θ_old is taken as the behaviour policy."""
    return None, {}


def check_tis_cap(*, tis_cap: float) -> None:
    if not tis_cap > 0:
        raise ValueError(f"tis_cap (the weight's upper bound) must be > 0, got {tis_cap}")


def check_band(*, is_mask_low: float, is_mask_high: float) -> None:
    if not 0 <= is_mask_low < is_mask_high:
        raise ValueError(
            f"the importance-sampling band needs 0 ≤ is_mask_low < is_mask_high, got [{is_mask_low}, {is_mask_high}]"
        )


@torch.no_grad()
def _truncated(log_w: torch.Tensor, mask: torch.Tensor, cap: float) -> Weights:
    raw = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weights = raw.clamp(max=cap) * mask
    stats = {
        "tis_weight_mean": masked_mean(weights, mask).item(),
        "tis_capped_frac": masked_mean((raw > cap).float(), mask).item(),
    }
    return weights, stats


@rollout_corrections.register(
    "tis-token", anchor="behaviour-policy-and-truncated-importance-sampling", check=check_tis_cap
)
def tis_token(x: CorrectionInputs, *, tis_cap: float = 2.0) -> Weights:
    """Truncated importance sampling per token: w_t = min(π_old/π_rollout, cap)."""
    return _truncated(_token_log_ratio(x), x.mask, tis_cap)


@rollout_corrections.register(
    "tis-sequence", anchor="behaviour-policy-and-truncated-importance-sampling", check=check_tis_cap, level="sequence"
)
def tis_sequence(x: CorrectionInputs, *, tis_cap: float = 2.0) -> Weights:
    """Truncated importance sampling per sequence: the product of the token ratios, capped, on all its tokens."""
    return _truncated(_sequence_log_ratio(x).expand_as(x.mask), x.mask, tis_cap)


@torch.no_grad()
def _masked(log_w: torch.Tensor, mask: torch.Tensor, low: float, high: float, *, weighted: bool = True) -> Weights:
    """w = ρ (or 1 when not `weighted`) where ρ = exp(log_w) lies in [low, high], 0 outside: masked, not
    truncated (the token stays in the normaliser). The band is tested on log ρ, so a ratio past float32
    is still compared exactly."""
    log_low = math.log(low) if low > 0 else -math.inf
    kept = (log_w >= log_low) & (log_w <= math.log(high))  # False for NaN: such a token is dropped
    return _kept_only(log_w, kept, mask, weighted=weighted)


@torch.no_grad()
def _kept_only(log_w: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor, *, weighted: bool = True) -> Weights:
    """w = ρ = exp(log_w) (or 1 when not `weighted`) on the `kept` tokens, 0 on the others; the weight's
    exponent is clamped (a band to ∞ keeps it finite)."""
    value = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() if weighted else torch.ones_like(log_w)
    weights = torch.where(kept & mask.bool(), value, 0.0)
    stats = {
        "is_weight_mean": masked_mean(weights, mask).item(),
        "is_masked_frac": masked_mean((~kept).float(), mask).item(),
    }
    return weights, stats


@rollout_corrections.register("mis-token", anchor="masked-importance-sampling-and-icepop", check=check_band)
def mis_token(x: CorrectionInputs, *, is_mask_low: float = 0.0, is_mask_high: float = 2.0) -> Weights:
    """Masked importance sampling per token: w_t = π_old/π_rollout inside [low, high], else 0 (the token is dropped)."""
    return _masked(_token_log_ratio(x), x.mask, is_mask_low, is_mask_high)


@rollout_corrections.register(
    "mis-sequence", anchor="masked-importance-sampling-and-icepop", check=check_band, level="sequence"
)
def mis_sequence(x: CorrectionInputs, *, is_mask_low: float = 0.5, is_mask_high: float = 2.0) -> Weights:
    """Masked importance sampling per sequence: w = ρ(y) = Π_t π_old/π_rollout inside [low, high], else 0."""
    return _masked(_sequence_log_ratio(x).expand_as(x.mask), x.mask, is_mask_low, is_mask_high)


@rollout_corrections.register(
    "geo-mask", anchor="masked-importance-sampling-and-icepop", check=check_band, level="sequence"
)
def geo_mask(x: CorrectionInputs, *, is_mask_low: float = 0.999, is_mask_high: float = 1.001) -> Weights:
    """Geometric sequence mask: w = 1 where the geometric mean ρ(y)^(1/|y|) is in [low, high], else 0."""
    log_geo = _sequence_log_ratio(x) / x.mask.sum(1, keepdim=True).clamp(min=1)
    return _masked(log_geo.expand_as(x.mask), x.mask, is_mask_low, is_mask_high, weighted=False)


@rollout_corrections.register("icepop", anchor="masked-importance-sampling-and-icepop", check=check_band)
def icepop(x: CorrectionInputs, *, is_mask_low: float = 0.5, is_mask_high: float = 5.0) -> Weights:
    """IcePop: two-sided token masking, w_t = π_old/π_rollout inside [α, β] = [0.5, 5], else 0."""
    return _masked(_token_log_ratio(x), x.mask, is_mask_low, is_mask_high)


@rollout_corrections.register(
    "tis-geo", anchor="sequence-weights-by-the-mean-log-ratio-opsm-and-kpop", check=check_tis_cap, level="sequence"
)
def tis_geo(x: CorrectionInputs, *, tis_cap: float = 2.0) -> Weights:
    """Truncated importance sampling per sequence by the mean log-ratio: w = min(ρ(y)^(1/|y|), cap), the
    geometric mean of the token ratios (AReaL's sequence-level weight), on all of the sequence's tokens."""
    log_geo = _sequence_log_ratio(x) / x.mask.sum(1, keepdim=True).clamp(min=1)
    return _truncated(log_geo.expand_as(x.mask), x.mask, tis_cap)


def check_opsm_delta(*, opsm_delta: float) -> None:
    if not opsm_delta >= 0:
        raise ValueError(f"opsm_delta (the sequence KL above which OPSM masks) must be ≥ 0, got {opsm_delta}")


@rollout_corrections.register(
    "opsm", anchor="sequence-weights-by-the-mean-log-ratio-opsm-and-kpop", check=check_opsm_delta, level="sequence"
)
@torch.no_grad()
def opsm(x: CorrectionInputs, *, opsm_delta: float = 1e-4) -> Weights:
    """Off-policy sequence masking (DeepSeek-V3.2; slime's `--use-opsm`): a sequence with a negative advantage
    whose mean log-ratio log π_rollout − log π_old (a k1 estimate of KL(π_rollout‖π_old)) exceeds δ is left
    out (weight 0); every other keeps weight 1."""
    if x.advantages is None:
        raise ValueError("opsm masks by the advantage's sign: its CorrectionInputs need `advantages`")
    tokens = x.mask.sum(1, keepdim=True).clamp(min=1)
    kl = -_sequence_log_ratio(x) / tokens
    advantage = (x.advantages * x.mask).sum(1, keepdim=True) / tokens
    masked = (advantage < 0) & (kl > opsm_delta)
    weights = (~masked).to(x.mask.dtype).expand_as(x.mask) * x.mask
    return weights, {"opsm_masked_frac": masked_mean(masked.expand_as(x.mask).float(), x.mask).item()}


def check_kpop_threshold(*, kpop_threshold: float) -> None:
    if not kpop_threshold > 0:
        raise ValueError(f"kpop_threshold (the binary KL a token may reach) must be > 0, got {kpop_threshold}")


@rollout_corrections.register("kpop", anchor="sequence-weights-by-the-mean-log-ratio-opsm-and-kpop", check=check_kpop_threshold)
@torch.no_grad()
def kpop(x: CorrectionInputs, *, kpop_threshold: float = 2.0) -> Weights:
    """KPop (AReaL): a token is kept, with weight π_old/π_rollout, when the binary KL between the two policies'
    probabilities of it, taken both ways, stays ≤ φ; else it is left out (weight 0). The divergence is computed
    from the log-probs, exactly however small a probability is (a token the engine gave 1e-15 against the
    trainer's 0.07 is D = 2.16, not the 1.04 a clamp at 1e-8 would read); a token either side gave probability
    0 is +inf away, and its ratio is not finite either: left out."""
    log_p, log_q = x.old_logp, x.rollout_logp
    log_w = _token_log_ratio(x)
    kept = (torch.maximum(binary_kl(log_p, log_q), binary_kl(log_q, log_p)) <= kpop_threshold) & log_w.isfinite()
    return _kept_only(log_w, kept, x.mask)
