"""On-policy distillation (docs/algorithms.md#on-policy-distillation): a teacher scores the tokens the student
sampled, and the per-token reverse KL is the learning signal, alone or beside the verifiable reward's advantage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlvr_lightning.pieces.kinds import AdvantageInputs, advantage_estimators
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP


def check_opd(*, opd_reward: str, opd_coef: float, opd_clip: float | None, opd_reward_knobs: dict[str, Any] | None = None) -> None:
    """`opd_reward_knobs`: the knobs of the estimator `opd_reward` names (checked as its own when it is bound)."""
    if opd_coef <= 0:
        raise ValueError(f"opd_coef must be > 0 (the weight of the teacher's term), got {opd_coef}")
    if opd_clip is not None and opd_clip <= 0:
        raise ValueError(f"opd_clip must be > 0 or null (no clipping), got {opd_clip}")
    if opd_reward not in advantage_estimators.names():
        raise ValueError(f"opd_reward must name a registered advantage estimator ({', '.join(advantage_estimators.names())})")
    if advantage_estimators.get(opd_reward)["teacher"]:
        raise ValueError(f"opd_reward={opd_reward!r} reads the teacher itself; name the reward's estimator (grpo, none, …)")
    if opd_reward_knobs is not None and not isinstance(opd_reward_knobs, dict):
        raise ValueError(f"opd_reward_knobs must be a mapping of {opd_reward}'s knobs, got {opd_reward_knobs!r}")
    theirs = advantage_estimators.get(opd_reward).knobs
    unknown = [k for k in opd_reward_knobs or {} if k not in theirs]
    if unknown:
        raise ValueError(f"opd_reward_knobs: {opd_reward} does not read the knob {unknown[0]!r}; its knobs: {', '.join(theirs) or 'none'}")


@advantage_estimators.register(
    "opd", anchor="on-policy-distillation", check=check_opd, teacher=True, wraps="opd_reward", wraps_in=advantage_estimators,
    wraps_knobs="opd_reward_knobs",
)
def opd_advantage(
    inputs: AdvantageInputs,
    *,
    opd_reward: str = "none",
    opd_coef: float = 1.0,
    opd_clip: float | None = None,
    wrapped: Callable | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation: token advantage Â_n + λ·clip(log π_T − log π_S, ±c), the negated per-token reverse KL.

    On each token the student sampled, log π_S(x_t) − log π_T(x_t) is the one-sample estimate of the reverse KL
    KL(π_S ‖ π_T) at that position (the student's own samples, as the estimate needs); its negation rewards the
    tokens the teacher finds likelier than the student did. `opd_reward` names the estimator of the verifiable
    reward's sequence advantage Â_n added on every token (`none`: distillation alone), run with the knobs
    `opd_reward_knobs` (`{pass_at_k: 2}`; its own defaults for the others); λ = `opd_coef`; c =
    `opd_clip` (None: only the library's log-ratio bound, ±20, which keeps a teacher's −inf finite). Tokens
    outside `mask` get 0. That estimator is selected as if on its own: it
    runs with its knobs and its checks (`wrapped`: it, bound, as the registry gives it).
    """
    d = inputs.distillation
    if d is None:
        raise ValueError("the advantage estimator `opd` needs a teacher (model.teacher.model_name_or_path)")
    mask = d.mask.bool()
    # A token the teacher gives probability 0 (log-prob −inf) would make the step non-finite: its gap stops at
    # the library's log-ratio bound, the strongest push a finite ratio gives.
    gap = (d.teacher_logp.float() - d.student_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    gap = torch.where(mask, gap, 0.0)
    signal = gap if opd_clip is None else gap.clamp(-opd_clip, opd_clip)
    reward = wrapped if wrapped is not None else advantage_estimators.get(opd_reward).bind({})  # called directly: defaults
    out = reward(inputs)
    sequence = (out[0] if isinstance(out, tuple) else out).to(gap)
    advantages = torch.where(mask, sequence[:, None] + opd_coef * signal, 0.0)
    tokens = mask.sum().clamp(min=1)
    stats = {"opd_reverse_kl": float(-gap.sum() / tokens)}
    if opd_clip is not None:
        stats["opd_clip_frac"] = float((gap.abs() > opd_clip).logical_and(mask).sum() / tokens)
    return advantages, stats
