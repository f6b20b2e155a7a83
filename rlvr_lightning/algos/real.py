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
micro-batch, which gives the same gradient for one extra forward.
"""

from __future__ import annotations

import torch

from rlvr_lightning.advantages import mixed_groups
from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.losses import RealVariant, real_grad_weights, real_loss, sequence_log_ratio
from rlvr_lightning.rollout.types import Rollout
from rlvr_lightning.training.batch import LossBatch, StepNorms
from rlvr_lightning.training.micro_batches import keeps_groups_whole


class REAL(RLVRModule):
    def __init__(
        self,
        tau: float = 0.5,
        variant: RealVariant = "anchor",
        two_pass: bool = False,
        mini_batches: int = 4,
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        """
        Args:
            tau: temperature of the sequence logits s̄/τ; the per-sequence gradient is bounded by 1/τ.
            variant: `anchor` (REAL), `bce` (REAL-BCE) or `pairwise` (anchor-free ablation).
            two_pass: allow micro-batches that split a group, with the exact two-pass gradient method.
            mini_batches: optimizer steps per rollout batch (the authors' recipe: 4).
            kl_coef: β of an optional KL penalty to the initial policy (off in the paper).
        """
        if tau <= 0:
            raise ConfigError(f"model.tau must be > 0, got {tau}")
        check_choice("model.variant", variant, RealVariant)
        if kwargs.get("tis_level", "off") != "off":
            raise ConfigError("model.tis_level re-weights token-level surrogates; REAL's loss is sequence-level")
        super().__init__(mini_batches=mini_batches, kl_coef=kl_coef, **kwargs)
        self.save_hyperparameters()

    def validate_config(self) -> None:
        super().validate_config()
        G = self.datamodule.hparams.group_size
        h = self.hparams
        if self.needs_whole_groups and not keeps_groups_whole(h.micro_batch_size, h.max_tokens_per_micro_batch, G):
            raise ConfigError(
                f"REAL couples the {G} rollouts of a group, but model.micro_batch_size="
                f"{self.hparams.micro_batch_size} would split groups: use a multiple of data.group_size={G}, "
                "or model.two_pass=true"
            )

    @property
    def two_pass(self) -> bool:
        return self.hparams.two_pass

    @property
    def needs_whole_groups(self) -> bool:  # the one-pass loss couples a group's rollouts
        return not self.hparams.two_pass

    def token_advantages_unsupported(self) -> str | None:
        return "REAL has no advantages to reshape (its loss uses the correctness labels); remove them"

    def compute_advantages(self, rollout: Rollout) -> torch.Tensor:
        # REAL has no advantages: its class labels are rollout.correct (see micro_batch_loss).
        return torch.zeros(rollout.num_sequences)

    def _normaliser(self, norms: StepNorms) -> float:
        # B (all prompts of the step) for anchor/pairwise; M (rollouts in mixed groups) for BCE.
        return max(1.0, norms.num_mixed_seqs if self.hparams.variant == "bce" else norms.num_groups)

    def micro_batch_loss(self, mb: LossBatch, logp: torch.Tensor, norms: StepNorms) -> tuple[torch.Tensor, dict]:
        h = self.hparams
        s_bar = sequence_log_ratio(logp, mb.old_logp, mb.loss_mask)
        loss = real_loss(s_bar, mb.correct, mb.group_size, self._normaliser(norms), h.tau, h.variant, norms.world_size)
        stats = self.sequence_stats(s_bar.detach(), mb.correct, mb.group_size)
        return loss + self.kl_loss(mb, logp, norms, stats), stats

    def sequence_loss_and_weights(
        self, s_bar: torch.Tensor, correct: torch.Tensor, G: int, norms: StepNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss from every s̄ of the step, and its closed-form ∂L/∂s̄ (the two-pass method)."""
        h = self.hparams
        normaliser = self._normaliser(norms)
        weights = real_grad_weights(s_bar, correct, G, normaliser, h.tau, h.variant)
        return real_loss(s_bar, correct, G, normaliser, h.tau, h.variant, norms.world_size), weights

    def sequence_stats(self, s_bar: torch.Tensor, correct: torch.Tensor, G: int) -> dict[str, torch.Tensor]:
        """The loss value is constant on policy, so log what moves: the logits of each class, the share
        of mixed groups and the per-sequence gradient weights |∂L_g/∂s̄_k| (bounded by 1/τ)."""
        h = self.hparams
        pos = correct > 0.5
        mixed = mixed_groups(correct, G)
        in_mixed = mixed.repeat_interleave(G)
        weights = real_grad_weights(s_bar, correct, G, 1.0, h.tau, h.variant)[in_mixed].abs()
        return {
            "s_bar_pos": s_bar[pos & in_mixed],
            "s_bar_neg": s_bar[~pos & in_mixed],
            "mixed_group_frac": mixed.float(),
            "grad_weight_abs_mean": weights,
            "grad_weight_abs_min": weights,
            "grad_weight_abs_max": weights,
        }
