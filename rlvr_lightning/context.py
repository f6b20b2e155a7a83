"""What the stages of a training step receive instead of the LightningModule: the step's context
(policy, engine session, tokenizer, prompt source, counters, collectives across ranks) and the scored
batch that the algorithm's rewards and advantages turn a rollout into. Built by the module once per step
from plain values and objects; the stages read it and return values, and never call the module back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig


@dataclass(frozen=True)
class Collectives:
    """Reductions across the trainer's ranks. Every rank must make the same calls in the same order."""

    world_size: int = 1
    rank: int = 0
    # reduce(tensor, reduce_op=…) in place over the ranks (`parallel.ranks_reduce`); None: a single process
    reduce: Callable[..., torch.Tensor] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    barrier: Callable[[], None] | None = None  # `parallel.ranks_barrier`; None: a single process

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, on x's device (NCCL reduces CUDA tensors only: it travels on the ranks' device)."""
        return x if self.reduce is None else self.reduce(x.to(self.device), reduce_op="sum").to(x.device)

    def agree(self, value: int, op: Literal["min", "max"]) -> int:
        """The min or max of an integer over all ranks."""
        if self.world_size == 1 or self.reduce is None:
            return value
        return int(self.reduce(torch.tensor(value, device=self.device), reduce_op=op))


class EngineSource(Protocol):
    """Where the step's rollout engine comes from (`rlvr_lightning.training.engine_session.EngineSession`),
    and the environment its answers are generated in (`rlvr_lightning.environments.base.Environment`; None:
    one segment per answer)."""

    @property
    def engine(self) -> RolloutEngine: ...

    @property
    def environment(self) -> Any: ...


class PromptSource(Protocol):
    """The training prompts (`rlvr_lightning.data.training_prompts.TrainingPrompts`)."""

    def batch_at(self, index: int) -> PromptBatch: ...
    def extra(self, n: int) -> PromptBatch: ...


@dataclass(frozen=True)
class StepContext:
    policy: torch.nn.Module
    ref_policy: torch.nn.Module | None
    engines: EngineSource  # its `engine` is built on first use (a stage that generates nothing starts none)
    tokenizer: Any
    prompts: PromptSource
    sampling: Callable[..., SamplingConfig]  # the training sampling settings, with overrides (`rollout:`)
    collectives: Collectives
    device: torch.device
    rollout_batch: int  # rollout batches completed before this step: this step's index
    policy_version: int  # weight syncs so far: the engine runs this version of the policy
    total_rollout_batches: float  # the run's length in rollout batches (math.inf when unbounded)
    seed: int  # the data seed every sampling and noise seed derives from
    scoring: Any = None  # the scoring stage (`training.scoring.Scoring`): correctness and reward terms
    observers: tuple = ()  # rollout callbacks that watch each scored rollout (`on_rollout_generated`)
    teacher: Any = None  # on-policy distillation's teacher (`training.teacher`), None without one
    # The first groups of this batch whose per-token entropy the step's result keeps (`StepResult.token_entropy`):
    # those a token view will show (`callbacks.completions`); 0 on the batches it does not log.
    entropy_groups: int = 0

    @property
    def engine(self) -> RolloutEngine:
        return self.engines.engine

    @property
    def environment(self) -> Any:
        return self.engines.environment


@dataclass(frozen=True)
class ScoredBatch:
    """A generated, scored rollout with the algorithm's rewards and sequence advantages."""

    rollout: Rollout
    rewards: torch.Tensor  # [N] r fed to the advantage estimator (shaped by the algorithm, e.g. DAPO)
    advantages: torch.Tensor  # [N] sequence advantages Â_n (of token advantages: their mean over sampled tokens)
    token_advantages: torch.Tensor | None = None  # [N, T] an estimator's own per-token advantages (distillation's)

    @property
    def group_size(self) -> int:
        return self.rollout.group_size


class RolloutObserver:
    """What the step calls on each freshly generated, scored rollout batch (a Lightning callback may be one)."""

    def on_rollout_generated(self, step: StepContext, rollout: Rollout) -> None:
        """After generation and scoring: the scored rollout (its correctness and reward terms), to watch; it returns
        None (the step refuses a returned value: give correctness with `rewards.correctness`)."""
        return None


class AdvantageShaper:
    """A stage that reweights token advantages (THR, OAR). Both hooks may be used at once.

    Weights are positive multipliers of the token advantages, so they never flip an advantage's sign;
    a token no shaper weighs keeps weight 1. Per rollout batch, the step calls `token_weights` once,
    after the advantages; then, if `hidden_rows` asks for them, it hands θ_old's LM-head inputs to
    `weights_from_hidden`, read from a forward that runs anyway (the θ_old pass, or the update's own
    forward when that runs at θ_old), a few whole groups at a time, each group exactly once (so a
    shaper knows its batch is fully scored when it has seen every group it asked for).

    `weighs_sampled_tokens_only`: True for a shaper that leaves an environment's inserted tokens (a tool's output,
    `Completion.sampled_mask`) out of its weights and their normalisation; a run in an environment refuses the others.
    `runs_on_sharded_ranks`: False for a shaper whose number of policy forwards depends on each rank's own rollouts
    (OAR's): with a policy sharded over several ranks every forward is a collective, so a run refuses it.

    A run builds its shapers from the module's `shapers` section (`rlvr_lightning.shapers`); yours is a subclass
    named there by its dotted path, with its constructor's keyword arguments.
    """

    weighs_sampled_tokens_only: bool = False
    runs_on_sharded_ranks: bool = True

    def token_weights(self, step: StepContext, batch: ScoredBatch) -> torch.Tensor | None:
        """Weights [N, T'] of the whole rollout batch computed from it and the policy at θ_old (OAR),
        or None. Also marks the start of a rollout batch for shapers that read hidden states."""
        return None

    def hidden_rows(self, batch: ScoredBatch) -> torch.Tensor | None:
        """Bool [N], whole groups: the sequences whose θ_old LM-head inputs `weights_from_hidden` reads."""
        return None

    def weights_from_hidden(
        self, step: StepContext, batch: ScoredBatch, hidden: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Weights [L_n] of sequence n from its θ_old LM-head inputs `hidden[n]` [L_n, d] (THR).
        `hidden` holds whole groups of the rows `hidden_rows` asked for, a few groups per call."""
        return {}

    def batch_metrics(self) -> dict[str, float]:
        """The last rollout batch's metrics (logged as `train/<key>`), read after its update."""
        return {}
