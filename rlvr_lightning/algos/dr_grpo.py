"""Dr. GRPO — "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv 2503.20783).

GRPO with exactly two changes that remove its optimisation biases (docs/algorithms.md#dr-grpo):
  1. no division by the group std (difficulty bias):   Â_i = r_i − mean(r)
  2. no 1/|o_i| (length bias, which favours long wrong answers): per-token losses are summed and
     divided by N_S · C with a *constant* C = max_response_length (`seq-mean-token-sum-norm`)

    J = E[ (1/G) Σ_i (1/C) Σ_t min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε, 1+ε) Â_i) ]

No KL (authors' code). Everything else is GRPO's.
"""

from __future__ import annotations

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.pieces.choices import AdvantageEstimatorChoice, LossAggChoice


class DrGRPO(GRPO):
    docs = "docs/algorithms.md#dr-grpo"

    def __init__(
        self,
        advantage_estimator: AdvantageEstimatorChoice = AdvantageEstimatorChoice("dr-grpo"),
        loss_agg: LossAggChoice = LossAggChoice("seq-mean-token-sum-norm"),
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        """
        Args:
            advantage_estimator: Dr. GRPO leaves advantages unscaled (`dr-grpo`).
            loss_agg: sum over tokens / (sequences × max_response_length).
            kl_coef: β of the KL penalty (the authors use none).
        """
        super().__init__(advantage_estimator=advantage_estimator, loss_agg=loss_agg, kl_coef=kl_coef, **kwargs)
