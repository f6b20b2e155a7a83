"""The six kinds of algorithm pieces, their registries, and the typed inputs each kind receives.

Shapes: N sequences stored group-contiguously (sequence n = b·G + j); per-token tensors are [n, T]
over response positions, `mask` is 1 on response tokens, and padded log-probs hold 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rlvr_lightning.pieces.registry import Registry, name_type


def _no_reduction(x: Tensor) -> Tensor:
    return x


@dataclass(frozen=True)
class DistillationInputs:
    """A teacher's view of the student's sampled tokens (on-policy distillation), on this rank."""

    student_logp: Tensor  # [N, T] log π_S of each sampled token: the engine's, the policy version that sampled it
    teacher_logp: Tensor  # [N, T] log π_T of the same token ids in the same context (the teacher at temperature 1)
    mask: Tensor  # [N, T] 1 on the tokens the student sampled (not padding, not what an environment inserted)


@dataclass(frozen=True)
class AdvantageInputs:
    """An advantage estimator's inputs: the rollout batch's rewards, on this rank."""

    rewards: Tensor  # [N] scalar rewards r
    correct: Tensor  # [N] verifier correctness c ∈ {0, 1}
    group_size: int  # G
    reduce_sum: Callable[[Tensor], Tensor] = _no_reduction  # sum across ranks (a collective: every rank calls it)
    lengths: Tensor | None = None  # [N] response tokens of each sequence (for token-weighted statistics)
    distillation: DistillationInputs | None = None  # the teacher's log-probs, for an estimator with the trait `teacher`


@dataclass(frozen=True)
class TokenLossInputs:
    """A token-level policy loss's inputs, for the sequences of one micro-batch."""

    logp: Tensor  # [n, T] log π_θ, with gradient
    old_logp: Tensor  # [n, T] log π_old (the behaviour policy), detached
    advantages: Tensor  # [n, T] token advantages (sequence advantages broadcast, maybe reshaped by THR/OAR)
    mask: Tensor  # [n, T] tokens that enter the loss
    selected: Tensor | None = None  # [n, T] bool: the tokens the loss's `token_selection` picked (Clip-Cov, KL-Cov)
    # θ is θ_old (a rollout batch's first optimizer step, θ_old from the trainer): the ratio is 1 up to the
    # rounding of two forwards laid out differently, which a loss non-smooth at ratio 1 must not act on.
    on_policy: bool = False


@dataclass(frozen=True)
class TokenSelectionInputs:
    """A token-level loss's selection over one optimizer step's tokens on this rank, made before the
    step's first forward from θ_old's view (so it is the same for any micro-batch layout)."""

    old_logp: Tensor  # [n, T] log π_old of the step's sequences
    advantages: Tensor  # [n, T] token advantages
    mask: Tensor  # [n, T]
    uniform: Callable[[Tensor], Tensor]  # local rows [k] (k ≥ 0) → [k, T] uniform draws keyed by (seed, step, sequence, position)
    reduce_sum: Callable[[Tensor], Tensor] = _no_reduction  # sum across ranks (a collective: every rank calls it)


@dataclass(frozen=True)
class GroupLossInputs:
    """A group-level policy loss's inputs: per-sequence logits of whole groups (REAL)."""

    s_bar: Tensor  # [n] length-normalised log-ratio to π_old of each sequence
    correct: Tensor  # [n] class labels c
    group_size: int
    normaliser: float  # the optimizer step's global count the loss is divided by (see the loss's trait)
    world_size: int = 1  # the loss is multiplied by it, undoing the ranks' gradient averaging


@dataclass(frozen=True)
class OptimizerStepNorms:
    """Global normalisers of one optimizer step, summed over its micro-batches and all ranks."""

    num_seqs: float  # N_S
    num_tokens: float  # T_S (loss-masked response tokens)
    num_groups: float  # B: prompts (REAL's normaliser)
    num_mixed_seqs: float  # M: rollouts in groups with mixed correctness (REAL-BCE's normaliser)
    world_size: int
    norm_const: float  # C of seq-mean-token-sum-norm: max_response_length, never an observed length


@dataclass(frozen=True)
class CorrectionInputs:
    """A rollout correction's inputs: the trainer's θ_old against the engine that sampled."""

    old_logp: Tensor  # [N, T] θ_old's log-probs as the trainer computes them
    rollout_logp: Tensor  # [N, T] the engine's log-probs of the sampled tokens
    mask: Tensor  # [N, T]
    advantages: Tensor | None = None  # [N, T] token advantages (OPSM masks by their sign)


@dataclass(frozen=True)
class ProximalInputs:
    """A proximal policy's inputs (decoupled PPO, docs/algorithms.md#decoupled-ppo-and-the-proximal-policy),
    for the sequences of one micro-batch, read in the update's forward."""

    behaviour_logp: Tensor  # [n, T] log π_behav: the engine's log-probs, each token's from the version that sampled it
    current_logp: Tensor  # [n, T] log π_θ of this forward, detached
    behaviour_version: Tensor  # [n, T] the policy version that sampled each token
    proximal_version: int  # the trainer's version when this rollout batch's update began (θ_old's)
    current_version: int  # proximal_version + the optimizer steps taken on this rollout batch so far
    mask: Tensor  # [n, T]


advantage_estimators = Registry(
    "advantage estimator",
    "model.advantage_estimator",
    "fn(AdvantageInputs, *, knobs) → sequence advantages [N] or token advantages [N, T], or (advantages, "
    "statistics {name: float})",
    # teacher: reads `AdvantageInputs.distillation` (the run needs `model.teacher`) and returns token advantages.
    # wraps: the knob naming another estimator it runs inside it, bound (`Piece.wrapped`); wraps_in: its registry;
    # wraps_knobs: the knob holding that estimator's knobs.
    traits={"teacher": False, "wraps": None, "wraps_in": None, "wraps_knobs": None},
)
policy_losses = Registry(
    "policy loss",
    "model.policy_loss",
    "token level: fn(TokenLossInputs, *, knobs) → (per-token loss [n, T], per-token stats); "
    "group level: fn(GroupLossInputs, *, knobs) → the step's loss over whole groups",
    # level: `token` (reduced by the loss aggregator) or `group` (couples a group's rollouts; REAL).
    # token_advantages: whether the loss honours per-token advantages (THR/OAR reshape them).
    # normaliser (group level): `groups` (B) or `mixed_sequences` (M), the count it is divided by.
    # grad_weights (group level): the closed-form ∂L/∂s̄ for the two-pass method, fn(GroupLossInputs, *, knobs).
    # token_selection (token level): picks tokens over the whole optimizer step before its forwards,
    # fn(TokenSelectionInputs, *, knobs) → (bool [n, T], statistics); the loss reads it as `selected`.
    # token_weights (token level): whether a per-token weight (a token-level rollout correction) acts on its
    # token alone; False for losses that write one sequence term on every token (GSPO, GMPO).
    traits={
        "level": "token",
        "token_advantages": True,
        "normaliser": None,
        "grad_weights": None,
        "token_selection": None,
        "token_weights": True,
    },
)
loss_aggregators = Registry(
    "loss aggregator", "model.loss_agg", "fn(per_token [n, T], mask [n, T], OptimizerStepNorms) → the micro-batch's loss"
)
kl_estimators = Registry(
    "KL estimator",
    "model.kl_estimator",
    "fn(logp [n, T], anchor_logp [n, T]) → per-token KL",
    # against: `reference` (the frozen initial policy, which the run then loads) or `behaviour` (π_old, the policy
    # that sampled: the regulariser keeps the update near it, and no reference model is loaded).
    traits={"against": "reference"},
)
rollout_corrections = Registry(
    "rollout correction",
    "model.rollout_correction",
    "fn(CorrectionInputs, *, knobs) → (detached per-token weights [N, T] or None, statistics)",
    # level: `token` (each token its own weight) or `sequence` (one weight on all of a sequence's tokens).
    traits={"level": "token"},
)

proximal_policies = Registry(
    "proximal policy",
    "model.proximal_policy",
    "fn(ProximalInputs, *, knobs) → log π_prox [n, T], detached (the clip's anchor; a rollout correction then weighs "
    "π_prox against π_behav)",
    # forward: θ_old comes from the trainer's no-grad pass before the update (the piece's function is not called).
    traits={"forward": False},
)

KINDS = (advantage_estimators, policy_losses, loss_aggregators, kl_estimators, rollout_corrections, proximal_policies)

AdvantageEstimatorName = name_type(advantage_estimators, "AdvantageEstimatorName", __name__)
PolicyLossName = name_type(policy_losses, "PolicyLossName", __name__)
LossAggName = name_type(loss_aggregators, "LossAggName", __name__)
KLEstimatorName = name_type(kl_estimators, "KLEstimatorName", __name__)
RolloutCorrectionName = name_type(rollout_corrections, "RolloutCorrectionName", __name__)
ProximalPolicyName = name_type(proximal_policies, "ProximalPolicyName", __name__)
