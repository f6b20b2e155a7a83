"""What the update reads: a rollout batch laid out for the loss (`UpdateInputs`), one micro-batch of
it with θ_old's log-probs always present (`LossBatch`), and the optimizer step's global counts
(`OptimizerStepNorms`, the loss aggregators' input)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.models.forward import PolicyForward
from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.pieces.kinds import OptimizerStepNorms
from rlvr_lightning.rollout.types import RolloutTensors
from rlvr_lightning.training.shaping import compose_token_weights


@dataclass(frozen=True)
class LossBatch:
    """Everything the loss of some sequences reads (a micro-batch, or a whole step)."""

    tensors: RolloutTensors
    advantages: torch.Tensor  # [n, T] token advantages, reshaped by the advantage shapers if any
    old_logp: torch.Tensor  # [n, T] behaviour-policy (θ_old) log-probs, 0 on padding
    ref_logp: torch.Tensor | None  # [n, T] reference log-probs when a KL term is used
    loss_mask: torch.Tensor  # [n, T] the tokens that enter the loss: sampled (not inserted, not padding), of
    # completions not masked out (truncated ones where the run masks them, those a stability guard excludes)
    is_weight: torch.Tensor | None  # [n, T] the rollout correction's weights, if any
    correct: torch.Tensor  # [n] verifier correctness c (REAL's class labels)
    group_size: int  # G; sequences are stored group-contiguously


class BehaviourLogprobs(Protocol):
    """Where a micro-batch's θ_old log-probs come from (see `training.behaviour`)."""

    source: str  # "trainer", "rollout" or "update"
    reads_lm_head: bool  # the update's forwards must capture the LM-head inputs (shapers read them there)

    def loss_batch(self, inputs: UpdateInputs, rows: torch.Tensor, forward: PolicyForward, updates: int = 0) -> LossBatch:
        """`updates`: the optimizer steps taken on this rollout batch before this forward."""

    def old_logp_all(self) -> torch.Tensor:
        """[N, T] θ_old log-probs of the whole rollout batch (for logging, after the update)."""
        ...

    def token_weights(self) -> torch.Tensor | None:
        """[N, T] the weights the shapers read from θ_old's LM-head inputs in the update's forwards, or None."""
        ...


@dataclass(frozen=True)
class UpdateInputs:
    """A rollout batch ready for the update. θ_old's log-probs come from `behaviour`, per micro-batch."""

    tensors: RolloutTensors
    advantages: torch.Tensor  # [N, T] token advantages, with the shapers' weights known before the update
    ref_logp: torch.Tensor | None
    loss_mask: torch.Tensor  # [N, T] as `LossBatch.loss_mask`: `tensors.sampled_mask` less the masked completions
    is_weight: torch.Tensor | None
    correct: torch.Tensor
    group_size: int
    temperature: float  # the rollout's sampling temperature: log-probs are those of π/T
    behaviour: BehaviourLogprobs
    shaper_weights: torch.Tensor | None = None  # [N, T] the shapers' own weights, before any forward (None: none)
    pass_weights: torch.Tensor | None = None  # [N, T] read from θ_old's LM-head inputs in the pass before the update

    def token_weights(self) -> torch.Tensor | None:
        """[N, T] every advantage shaper's token weights, composed (None: no shaper weighs): their own, and those
        read from θ_old's LM-head inputs, in the pass before the update or in its forwards (complete after it)."""
        read = compose_token_weights(self.pass_weights, self.behaviour.token_weights())
        return compose_token_weights(self.shaper_weights, read)

    def loss_batch(self, rows: torch.Tensor, forward: PolicyForward, updates: int = 0) -> LossBatch:
        """The micro-batch `rows` as the loss reads it, given its forward under the current policy."""
        return self.behaviour.loss_batch(self, rows, forward, updates)

    def with_behaviour(self, behaviour: BehaviourLogprobs) -> UpdateInputs:
        return replace(self, behaviour=behaviour)

    @cached_property  # read by every optimizer step's layout; one device sum and host copy per batch
    def token_counts(self) -> torch.Tensor:
        """[N, 2] real prompt and response tokens of each sequence (host): what micro-batches by token
        budget pack."""
        return self.tensors.token_counts


def select_loss_batch(
    inputs: UpdateInputs, rows: torch.Tensor, tensors: RolloutTensors, old_logp: torch.Tensor, advantages=None
) -> LossBatch:
    """The rows of `inputs` laid out as `tensors` (their trimmed forward inputs), with the given θ_old
    log-probs (and advantages, when reshaped in the update); [n, T] tensors are cut to its width."""
    width = tensors.response_mask.shape[1]

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[rows, :width]

    return LossBatch(
        tensors,
        pick(inputs.advantages) if advantages is None else advantages[:, :width],
        old_logp[:, :width],
        pick(inputs.ref_logp),
        pick(inputs.loss_mask),
        pick(inputs.is_weight),
        inputs.correct[rows],
        inputs.group_size,
    )


def optimizer_step_norms(inputs: UpdateInputs, rows: torch.Tensor, collectives: Collectives, norm_const: float) -> OptimizerStepNorms:
    """The counts of the optimizer step over `rows`, summed across ranks with one all-reduce."""
    G = inputs.group_size
    mask = inputs.loss_mask[rows]
    mixed = mixed_groups(inputs.correct[rows], G)
    counts = torch.tensor(
        [float(mask.shape[0]), mask.sum().item(), mask.shape[0] / G, G * mixed.sum().item()], device=mask.device
    )
    return OptimizerStepNorms(*collectives.sum(counts).tolist(), world_size=collectives.world_size, norm_const=norm_const)
