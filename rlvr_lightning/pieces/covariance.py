"""Clip-Cov and KL-Cov (docs/algorithms.md#clip-cov-and-kl-cov; Cui et al., "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617). The policy's entropy falls
with the covariance of a token's log-probability and its advantage; both losses act on a small share
of the tokens whose covariance is highest.

Each token's covariance is c_t = (Â_t − mean Â)·(log π_old(y_t) − mean log π_old), the means over the
optimizer step's response tokens on every rank, so mean c_t over the step is Cov(log π, Â). The
selection is made once per optimizer step, from θ_old's log-probs, before the step's first forward:
it does not depend on the micro-batch layout or the number of ranks. (The paper's code selects per
micro-batch at the current θ: the same tokens at a rollout batch's first, on-policy step when one
micro-batch holds the step.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlvr_lightning.pieces.kinds import TokenLossInputs, TokenSelectionInputs, policy_losses
from rlvr_lightning.pieces.token_losses import LossAndStats, check_ratio_band, ppo_clip
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP

Selection = tuple[Tensor, dict[str, Tensor]]


@torch.no_grad()
def token_covariance(x: TokenSelectionInputs) -> tuple[Tensor, Tensor, float]:
    """(c_t [n, T], the tokens where it is defined [n, T], the step's token count on all ranks). A token
    whose log-prob or advantage is not finite is left out (it would make every c_t NaN)."""
    mask = x.mask.bool() & x.old_logp.isfinite() & x.advantages.isfinite()
    # float64 sums (exact token counts past 2**24); one collective carries the count and both sums.
    f64 = torch.float64
    sums = torch.stack(
        [
            mask.sum(dtype=f64),
            torch.where(mask, x.advantages, 0.0).sum(dtype=f64),
            torch.where(mask, x.old_logp, 0.0).sum(dtype=f64),
        ]
    )
    count, adv_sum, logp_sum = x.reduce_sum(sums).tolist()
    if count == 0:
        return torch.zeros_like(x.old_logp), mask, 0.0
    centred = (x.advantages - adv_sum / count) * (x.old_logp - logp_sum / count)
    cov = torch.where(mask, centred, 0.0).float()
    return cov, mask, count


def covariance_stats(cov: Tensor, valid: Tensor, selected: Tensor) -> dict[str, Tensor]:
    """Per-token statistics (token-weighted means over the step) and samples (their mean or max)."""
    return {
        "cov_mean": cov,  # its token mean is the step's Cov(log π_old, Â)
        "cov_max": cov[valid],
        "cov_selected_frac": selected,
        "cov_selected_mean": cov[selected],
    }


def global_counts(reduce_sum, *masks: Tensor) -> list[int]:
    """How many tokens each mask holds over all ranks, in one collective."""
    return [int(c) for c in reduce_sum(torch.stack([m.sum(dtype=torch.float64) for m in masks])).tolist()]


def order_keys(x: Tensor) -> Tensor:
    """int64 keys ordered as the float32 values `x` (IEEE bits, negatives' magnitude bits flipped); −0.0
    and +0.0 get one key (a product of a zero advantage is either, and they are the same value)."""
    bits = (x.float() + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@torch.no_grad()
def kth_largest_key(keys: Tensor, valid: Tensor, k: int, reduce_sum) -> int:
    """The exact k-th largest of the valid `keys` over all ranks, by bisection on counts: 32 scalar
    all-reduces instead of gathering every rank's values (67M tokens at 512 prompts × 16 × 8k)."""
    lo, hi = -(2**31), 2**31  # at least k keys are ≥ lo; fewer than k are ≥ hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if global_counts(reduce_sum, (keys >= mid) & valid)[0] >= k:
            lo = mid
        else:
            hi = mid
    return lo


def _check_share(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} is the share of the step's tokens to select, in (0, 1]; got {value}")


def check_clip_cov(
    *, clip_eps_low: float, clip_eps_high: float, clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float
) -> None:
    check_ratio_band(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    _check_share("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb < clip_cov_ub is needed; got {clip_cov_lb}, {clip_cov_ub}")


def check_kl_cov(*, kl_cov_coef: float, kl_cov_ratio: float) -> None:
    _check_share("kl_cov_ratio", kl_cov_ratio)
    if kl_cov_coef < 0:
        raise ValueError(f"kl_cov_coef is the penalty's β ≥ 0; got {kl_cov_coef}")


def clip_cov_selection(
    x: TokenSelectionInputs, *, clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0
) -> Selection:
    """Clip-Cov's tokens: each token whose covariance lies in (lb, ub) is drawn with the probability that
    makes the expected count `clip_cov_ratio` × the step's tokens (all candidates when fewer)."""
    cov, valid, count = token_covariance(x)
    candidates = valid & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    (num_candidates,) = global_counts(x.reduce_sum, candidates)
    selected = torch.zeros_like(candidates)
    rows = candidates.any(1).nonzero().squeeze(1)  # may be none on this rank (the draws take an empty request)
    if num_candidates > 0:
        rate = min(1.0, clip_cov_ratio * count / num_candidates)
        selected[rows] = candidates[rows] & (x.uniform(rows) < rate)
    return selected, covariance_stats(cov, valid, selected)


def kl_cov_selection(x: TokenSelectionInputs, *, kl_cov_ratio: float = 2e-3) -> Selection:
    """KL-Cov's tokens: exactly the top `kl_cov_ratio` share of the step's tokens by covariance, at least
    one. Ties at the boundary are common (a step whose advantages are all 0 has c ≡ 0): a random few of
    the tied tokens make up the count, drawn by position, so the choice does not depend on the layout."""
    cov, valid, count = token_covariance(x)
    if count == 0:
        return torch.zeros_like(valid), covariance_stats(cov, valid, torch.zeros_like(valid))
    k = max(1, int(count * kl_cov_ratio))
    keys = order_keys(cov)
    threshold = kth_largest_key(keys, valid, k, x.reduce_sum)
    above, tied = valid & (keys > threshold), valid & (keys == threshold)
    num_above, num_tied = global_counts(x.reduce_sum, above, tied)
    missing = k - num_above
    if num_tied > missing:
        rows = tied.any(1).nonzero().squeeze(1)  # may be none on this rank: the collectives below still run
        draws = torch.ones_like(cov)
        draws[rows] = x.uniform(rows).to(draws)
        draw_keys = order_keys(-draws)  # the smallest draws rank first
        tied &= draw_keys >= kth_largest_key(draw_keys, tied, missing, x.reduce_sum)
    selected = above | tied
    return selected, covariance_stats(cov, valid, selected)


def _selected(x: TokenLossInputs) -> Tensor:
    if x.selected is None:
        raise ValueError("this loss reads its token selection (TokenLossInputs.selected): the update makes it per step")
    return x.selected


@policy_losses.register("clip-cov", anchor="clip-cov-and-kl-cov", check=check_clip_cov, token_selection=clip_cov_selection)
def clip_cov(x: TokenLossInputs, *, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2) -> LossAndStats:
    """Clip-Cov: PPO's clipped surrogate, the gradient of a few random high-covariance tokens detached.

    Their loss value still counts and they stay in the normaliser; `clip_cov_selection` draws them."""
    per_tok, stats = ppo_clip(x, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    return torch.where(_selected(x), per_tok.detach(), per_tok), stats


@policy_losses.register("kl-cov", anchor="clip-cov-and-kl-cov", check=check_kl_cov, token_selection=kl_cov_selection)
def kl_cov(x: TokenLossInputs, *, kl_cov_coef: float = 1.0) -> LossAndStats:
    """KL-Cov: the unclipped surrogate −r·Â, plus β·|log π_θ − log π_old| on the top-covariance tokens.

    The top share is `kl_cov_selection`'s, made once per optimizer step."""
    log_ratio = (x.logp - x.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    # On policy |log-ratio| is 0 (no gradient); θ_old from another forward leaves rounding noise whose
    # sign would give every selected token a full ±β gradient, different for every micro-batch layout.
    penalty = 0.0 if x.on_policy else kl_cov_coef * log_ratio.abs() * _selected(x)
    none = torch.zeros_like(x.mask, dtype=torch.bool)
    return -x.advantages * ratio + penalty, {"ratio": ratio.detach(), "clipped_low": none, "clipped_high": none}
