"""KL estimators (docs/algorithms.md#kl-penalty): per-token estimates of KL(π_θ‖π_ref) from the sampled
tokens' log-probs (Schulman's k1, k2, k3), and Kimi's squared log-ratio to the behaviour policy."""

from __future__ import annotations

from torch import Tensor

from rlvr_lightning.pieces.kinds import kl_estimators
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP


@kl_estimators.register("k1", anchor="kl-penalty")
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log π_θ − log π_ref: unbiased, high variance, can be negative."""
    return logp - ref_logp


@kl_estimators.register("k2", anchor="kl-penalty")
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """½ (log π_θ − log π_ref)²: biased, low variance."""
    return 0.5 * (logp - ref_logp) ** 2


@kl_estimators.register("k3", anchor="kl-penalty")
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """e^d − d − 1 with d = log π_ref − log π_θ: unbiased, non-negative (GRPO); clamped as in verl."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (d.exp() - d - 1).clamp(-10.0, 10.0)


@kl_estimators.register("kimi", anchor="kimi-style-regulariser", against="behaviour")
def kimi(logp: Tensor, old_logp: Tensor) -> Tensor:
    """(log π_θ − log π_old)², anchored to the policy that sampled (Kimi K2.5): τ = kl_coef, no ½."""
    return (logp - old_logp) ** 2
