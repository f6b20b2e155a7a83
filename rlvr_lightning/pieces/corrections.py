"""Rollout corrections (docs/algorithms.md#behaviour-policy-and-truncated-importance-sampling): weights
on the policy term against the engine ≠ trainer mismatch. The engine samples from π_rollout while the
loss's ratio is taken against π_old as the trainer computes it (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; verl's rollout importance sampling)."""

from __future__ import annotations

import torch

from rlvr_lightning.pieces.kinds import CorrectionInputs, rollout_corrections
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP, masked_mean

Weights = tuple[torch.Tensor | None, dict[str, float]]


@rollout_corrections.register("none", anchor="behaviour-policy-and-truncated-importance-sampling")
def no_correction(x: CorrectionInputs) -> Weights:
    """No correction: the trainer's θ_old is taken as the behaviour policy."""
    return None, {}


@torch.no_grad()
def _truncated(log_w: torch.Tensor, mask: torch.Tensor, cap: float) -> Weights:
    raw = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weights = raw.clamp(max=cap) * mask
    stats = {
        "tis_weight_mean": masked_mean(weights, mask).item(),
        "tis_capped_frac": masked_mean((raw > cap).float(), mask).item(),
    }
    return weights, stats


@rollout_corrections.register("tis-token", anchor="behaviour-policy-and-truncated-importance-sampling")
def tis_token(x: CorrectionInputs, *, tis_cap: float) -> Weights:
    """Truncated importance sampling per token: w_t = min(π_old/π_rollout, cap)."""
    return _truncated((x.old_logp - x.rollout_logp) * x.mask, x.mask, tis_cap)


@rollout_corrections.register("tis-sequence", anchor="behaviour-policy-and-truncated-importance-sampling")
def tis_sequence(x: CorrectionInputs, *, tis_cap: float) -> Weights:
    """Truncated importance sampling per sequence: the product of the token ratios, capped, on all its tokens."""
    log_w = ((x.old_logp - x.rollout_logp) * x.mask).sum(1, keepdim=True).expand_as(x.mask)
    return _truncated(log_w, x.mask, tis_cap)
