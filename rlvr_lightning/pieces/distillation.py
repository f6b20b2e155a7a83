"""On-policy distillation (docs/algorithms.md#on-policy-distillation): a teacher scores the tokens the student
sampled, and the per-token reverse KL is the learning signal, alone or beside the verifiable reward's advantage."""

from __future__ import annotations

import torch

from rlvr_lightning.pieces.kinds import AdvantageInputs, advantage_estimators


def check_opd(*, opd_reward: str, opd_coef: float, opd_clip: float | None) -> None:
    if opd_coef <= 0:
        raise ValueError(f"opd_coef must be > 0 (the weight of the teacher's term), got {opd_coef}")
    if opd_clip is not None and opd_clip <= 0:
        raise ValueError(f"opd_clip must be > 0 or null (no clipping), got {opd_clip}")
    if opd_reward not in advantage_estimators.names():
        raise ValueError(f"opd_reward must name a registered advantage estimator ({', '.join(advantage_estimators.names())})")
    if advantage_estimators.get(opd_reward)["teacher"]:
        raise ValueError(f"opd_reward={opd_reward!r} reads the teacher itself; name the reward's estimator (grpo, none, …)")


@advantage_estimators.register("opd", anchor="on-policy-distillation", check=check_opd, teacher=True)
def opd_advantage(
    inputs: AdvantageInputs, *, opd_reward: str = "none", opd_coef: float = 1.0, opd_clip: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """On-policy distillation: token advantage Â_n + λ·clip(log π_T − log π_S, ±c), the negated per-token reverse KL.

    On each token the student sampled, log π_S(x_t) − log π_T(x_t) is the one-sample estimate of the reverse KL
    KL(π_S ‖ π_T) at that position (the student's own samples, as the estimate needs); its negation rewards the
    tokens the teacher finds likelier than the student did. `opd_reward` names the estimator of the verifiable
    reward's sequence advantage Â_n added on every token (`none`: distillation alone); λ = `opd_coef`; c =
    `opd_clip` (None: unclipped). Tokens outside `mask` get 0.
    """
    d = inputs.distillation
    if d is None:
        raise ValueError("the advantage estimator `opd` needs a teacher (model.teacher.model_name_or_path)")
    mask = d.mask.bool()
    gap = torch.where(mask, d.teacher_logp.float() - d.student_logp.float(), 0.0)
    signal = gap if opd_clip is None else gap.clamp(-opd_clip, opd_clip)
    out = advantage_estimators.get(opd_reward).fn(inputs)
    sequence = (out[0] if isinstance(out, tuple) else out).to(gap)
    advantages = torch.where(mask, sequence[:, None] + opd_coef * signal, 0.0)
    tokens = mask.sum().clamp(min=1)
    stats = {"opd_reverse_kl": float(-gap.sum() / tokens)}
    if opd_clip is not None:
        stats["opd_clip_frac"] = float((gap.abs() > opd_clip).logical_and(mask).sum() / tokens)
    return advantages, stats
