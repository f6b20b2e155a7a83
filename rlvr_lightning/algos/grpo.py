"""GRPO — Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300).

    J = E_q E_{o_1..G ~ π_old} [ (1/G) Σ_i (1/|o_i|) Σ_t { min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high) Â_i)
                                                         − β k3_{i,t} } ]

with Â_i the group-normalised reward (ALGORITHMS.md §1.1, unbiased std) broadcast to every token,
ρ = π_θ / π_old per token, aggregation seq-mean-token-mean, and an optional k3 KL to the frozen
initial policy. Everything else (rollout, rewards, updates, weight sync) is the shared step.
"""

from __future__ import annotations

import torch

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.losses import LossAgg, ppo_clip


class GRPO(RLVRModule):
    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        loss_agg: LossAgg = "seq-mean-token-mean",
        use_adv_std: bool = True,
        **kwargs,
    ) -> None:
        """
        Args:
            clip_eps_low / clip_eps_high: PPO clip range [1−ε_low, 1+ε_high] of the token ratio.
            kl_coef: β of the k3 KL penalty to the initial policy (0 = off, no reference model).
        """
        super().__init__(
            kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg, use_adv_std=use_adv_std, **kwargs
        )
        self.save_hyperparameters()

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return ppo_clip(logp, old_logp, adv, self.hparams.clip_eps_low, self.hparams.clip_eps_high)
