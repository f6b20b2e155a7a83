"""REAL — Rewards as Labels: RLVR as classification (arXiv 2602.05630; docs/algorithms.md#real).

Each rollout's logit is its length-normalised log-ratio to the rollout policy, s̄_k/τ. Correct
rollouts (O+) are the positive class, incorrect ones (O−) the negative class, and a fixed anchor
logit 0 sits on both sides:

    L_g = log(1 + Σ_{i∈O+} e^{−s̄_i/τ}) + log(1 + Σ_{j∈O−} e^{s̄_j/τ}),    L = (1/B) Σ_{mixed g} L_g

No advantages, no clipping, no KL by default. Unlike a clipped surrogate the gradient with respect
to each s̄_k is bounded by 1/τ (per group), shrinks for positives that are already likely, and
saturates for negatives instead of growing without bound. Variants: `bce` (independent
BCE-with-logits on s̄/τ, normalised by the rollouts in mixed groups) and `pairwise` (anchor-free).

The loss couples the members of a group, so micro-batches must hold whole groups, or
`two_pass: true` computes every s̄ first (no grad) and backpropagates sg[∂L/∂s̄_k]·s̄_k per
micro-batch, which gives the same gradient for one extra forward. The losses are registered pieces
(`rlvr_lightning.pieces.real`), so any algorithm can use them; this class sets REAL's defaults.
"""

from __future__ import annotations

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.pieces.choices import AdvantageEstimatorChoice, PolicyLossChoice


class REAL(RLVRModule):
    docs = "docs/algorithms.md#real"

    def __init__(
        self,
        policy_loss: PolicyLossChoice = PolicyLossChoice("real-anchor", {"tau": 0.5}),
        advantage_estimator: AdvantageEstimatorChoice = AdvantageEstimatorChoice("none"),
        two_pass: bool = False,
        num_mini_batches: int = 4,
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        """
        Args:
            policy_loss: `real-anchor` (REAL), `real-bce` (REAL-BCE) or `real-pairwise` (anchor-free ablation), with
                its knob `tau`, the temperature of the sequence logits s̄/τ (> 0): the per-sequence gradient is bounded
                by 1/τ.
            advantage_estimator: `none`: REAL's loss reads the correctness labels, not advantages.
            two_pass: allow micro-batches that split a group, with the exact two-pass gradient method.
            num_mini_batches: optimizer steps per rollout batch (the authors' recipe: 4).
            kl_coef: β of an optional KL penalty to the initial policy (off in the paper).
        """
        # `two_pass` reaches the objective through the module's recorded arguments.
        super().__init__(
            policy_loss=policy_loss, advantage_estimator=advantage_estimator, num_mini_batches=num_mini_batches,
            kl_coef=kl_coef, **kwargs,
        )
