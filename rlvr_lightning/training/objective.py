"""The update's loss, composed from bound pieces: a policy loss (token- or group-level), the loss
aggregator, the KL estimator with its coefficient. The update calls it per micro-batch, or, for
group-level losses whose micro-batches split groups, through the two-pass method."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.pieces.kinds import (
    GroupLossInputs,
    OptimizerStepNorms,
    TokenLossInputs,
    kl_estimators,
    loss_aggregators,
    policy_losses,
)
from rlvr_lightning.pieces.registry import Piece, chosen_knobs
from rlvr_lightning.pieces.token_losses import sequence_log_ratio
from rlvr_lightning.training.batch import LossBatch


@dataclass(frozen=True)
class Objective:
    policy_loss: Piece
    loss: Callable  # the policy loss with its knobs bound
    aggregate: Callable  # the loss aggregator
    kl: Callable | None  # the KL estimator; None: no KL term (and no reference policy)
    kl_coef: float
    kl_against: str = "reference"  # the policy the KL term is taken against (the estimator's `against` trait)
    two_pass: bool = False  # group-level loss over micro-batches that split groups (`training.update`)
    grad_weights: Callable | None = None  # group level: the closed-form ∂L/∂s̄ with the knobs bound
    select: Callable | None = None  # token level: the loss's token selection over a step, knobs bound

    @property
    def needs_reference(self) -> bool:
        """A KL term against the frozen initial policy: the run loads it."""
        return self.kl is not None and self.kl_against == "reference"

    @property
    def group_level(self) -> bool:
        return self.policy_loss["level"] == "group"

    @property
    def reads_step_first(self) -> bool:
        """The loss reads the whole optimizer step before its first forward with grad (θ_old must be known)."""
        return self.two_pass or self.select is not None

    @property
    def needs_whole_groups(self) -> bool:
        """Micro-batches must hold whole groups: the one-pass loss couples a group's rollouts."""
        return self.group_level and not self.two_pass

    def micro_batch_loss(
        self,
        mb: LossBatch,
        logp: torch.Tensor,
        norms: OptimizerStepNorms,
        selected: torch.Tensor | None = None,
        on_policy: bool = False,
    ) -> tuple[torch.Tensor, dict]:
        """Scalar loss of one micro-batch, already divided by the step's global normalisers; `selected`:
        the micro-batch's share of the step's token selection (losses with a `token_selection`);
        `on_policy`: θ is θ_old (`TokenLossInputs.on_policy`)."""
        if self.group_level:
            s_bar = sequence_log_ratio(logp, mb.old_logp, mb.loss_mask)
            loss = self.loss(self.group_inputs(s_bar, mb.correct, mb.group_size, norms))
            stats = self.sequence_stats(s_bar.detach(), mb.correct, mb.group_size)
        else:
            per_tok, stats = self.loss(TokenLossInputs(logp, mb.old_logp, mb.advantages, mb.loss_mask, selected, on_policy))
            if mb.is_weight is not None:  # the rollout correction re-weights the policy term only, as in verl
                per_tok = per_tok * mb.is_weight
            loss = self.aggregate(per_tok, mb.loss_mask, norms)
        return loss + self.kl_loss(mb, logp, norms, stats), stats

    def kl_loss(self, mb: LossBatch, logp: torch.Tensor, norms: OptimizerStepNorms, stats: dict) -> torch.Tensor:
        """β·KL(π_θ‖π_ref) inside the loss, with the same aggregator as the policy term (or against π_old, the
        behaviour policy, for an estimator whose `against` trait says so)."""
        if self.kl is None:
            return logp.new_zeros(())
        kl = self.kl(logp, mb.old_logp if self.kl_against == "behaviour" else mb.ref_logp)
        stats["kl"] = kl.detach()
        return self.kl_coef * self.aggregate(kl, mb.loss_mask, norms)

    # ---- group-level losses (REAL) --------------------------------------------------------------
    def group_inputs(self, s_bar: torch.Tensor, correct: torch.Tensor, G: int, norms: OptimizerStepNorms) -> GroupLossInputs:
        # B (all prompts of the step) or M (rollouts in mixed groups), by the loss's `normaliser` trait.
        count = norms.num_mixed_seqs if self.policy_loss["normaliser"] == "mixed_sequences" else norms.num_groups
        return GroupLossInputs(s_bar, correct, G, max(1.0, count), norms.world_size)

    def sequence_loss_and_weights(
        self, s_bar: torch.Tensor, correct: torch.Tensor, G: int, norms: OptimizerStepNorms
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss from every s̄ of the step, and its closed-form ∂L/∂s̄ (the two-pass method)."""
        inputs = self.group_inputs(s_bar, correct, G, norms)
        return self.loss(inputs), self.grad_weights(inputs)

    def sequence_stats(self, s_bar: torch.Tensor, correct: torch.Tensor, G: int) -> dict[str, torch.Tensor]:
        """The loss value is constant on policy, so log what moves: the logits of each class, the share
        of mixed groups and the per-sequence gradient weights |∂L_g/∂s̄_k| (bounded by 1/τ)."""
        pos = correct > 0.5
        mixed = mixed_groups(correct, G)
        in_mixed = mixed.repeat_interleave(G)
        weights = self.grad_weights(GroupLossInputs(s_bar, correct, G, 1.0))[in_mixed].abs()
        return {
            "s_bar_pos": s_bar[pos & in_mixed],
            "s_bar_neg": s_bar[~pos & in_mixed],
            "mixed_group_frac": mixed.float(),
            "grad_weight_abs_mean": weights,
            "grad_weight_abs_min": weights,
            "grad_weight_abs_max": weights,
        }


def compose_objective(values: Mapping[str, Any]) -> Objective:
    """The objective an algorithm's arguments select: `policy_loss`, `loss_agg`, `kl_estimator` (used when
    `kl_coef` > 0), each with the knobs its choice gives, and `two_pass`."""
    loss, knobs = policy_losses.selected(values), chosen_knobs(values["policy_loss"])
    grad_weights, select = loss["grad_weights"], loss["token_selection"]
    return Objective(
        policy_loss=loss, loss=loss.bind(knobs), aggregate=loss_aggregators.bound(values),
        kl=kl_estimators.bound(values) if values["kl_coef"] > 0 else None,
        kl_coef=values["kl_coef"], kl_against=kl_estimators.selected(values)["against"],
        two_pass=values.get("two_pass", False),
        grad_weights=None if grad_weights is None else loss.bind(knobs, grad_weights),
        select=None if select is None else loss.bind(knobs, select),
    )  # fmt: skip
