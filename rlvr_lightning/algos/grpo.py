"""GRPO — Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300).

    J = E_q E_{o_1..G ~ π_old} [ (1/G) Σ_i (1/|o_i|) Σ_t { min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high) Â_i)
                                                         − β k3_{i,t} } ]

with Â_i the group-normalised reward (docs/algorithms.md#group-relative-advantages, unbiased std) broadcast to every token,
ρ = π_θ / π_old per token, aggregation seq-mean-token-mean, and an optional k3 KL to the frozen
initial policy. Everything else (rollout, rewards, updates, weight sync) is the shared step.

This class is also the chassis of the GRPO family: each piece is a pure function chosen by name
(advantage std on/off, surrogate, aggregator, KL estimator), so Dr. GRPO, DAPO and GSPO are this
module with other pieces and other defaults (`dr_grpo.py`, `dapo.py`, `gspo.py`).
"""

from __future__ import annotations

import torch

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.losses import SURROGATES, KLEstimator, LossAgg, Surrogate


class GRPO(RLVRModule):
    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        surrogate: Surrogate = "ppo-clip",
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        loss_agg: LossAgg = "seq-mean-token-mean",
        use_adv_std: bool = True,
        **kwargs,
    ) -> None:
        """
        Args:
            clip_eps_low / clip_eps_high: clip range [1−ε_low, 1+ε_high] of the ratio (ε_high > ε_low is
                DAPO's clip-higher).
            surrogate: `ppo-clip` (per-token ratio), `gspo` (sequence ratio) or `gspo-token`.
            kl_coef: β of the KL penalty to the initial policy (0 = off, no reference model).
        """
        check_choice("model.surrogate", surrogate, SURROGATES)
        if not (0 <= clip_eps_low < 1 and clip_eps_high >= 0):
            raise ConfigError(f"model.clip_eps_low must be in [0, 1) and clip_eps_high ≥ 0, got {clip_eps_low}, {clip_eps_high}")
        super().__init__(
            kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg, use_adv_std=use_adv_std, **kwargs
        )
        self.save_hyperparameters()
        # Kept as an attribute, not read from hparams: under LightningCLI the hparams are the user's
        # config, where a subclass (GSPO) may choose the surrogate from another argument.
        self.surrogate = surrogate

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.hparams
        return SURROGATES[self.surrogate](logp, old_logp, adv, mask, h.clip_eps_low, h.clip_eps_high)
