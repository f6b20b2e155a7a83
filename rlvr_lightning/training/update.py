"""The policy update of one rollout batch: `ppo_epochs` passes of `num_mini_batches` optimizer steps, each
accumulating the gradient of its loss over micro-batches, then clipping and stepping.

Every micro-batch loss is divided by the optimizer step's global counts (`OptimizerStepNorms`), so the
accumulated gradient is the same for any micro-batch size and any number of ranks. Two ways to
accumulate:
  - micro-batches (default): forward, the objective's `micro_batch_loss`, backward, per micro-batch;
  - two-pass, for losses of per-sequence scalars that couple a group's rollouts (REAL) when micro-batches
    split groups: pass 1 computes every sequence's s̄ without grad, the algorithm's closed-form
    ∂L/∂s̄ (the loss's `grad_weights`) gives each sequence a weight, pass 2 backpropagates weight · s̄ micro-batch by micro-batch —
    the same gradient for one extra forward.
An optimizer step whose gradient norm is not finite is skipped (weights and optimizer state
untouched); `max_nonfinite_steps` in a row stop the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from rlvr_lightning.context import StepContext
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.pieces.kinds import OptimizerStepNorms, TokenSelectionInputs
from rlvr_lightning.pieces.token_losses import sequence_log_ratio
from rlvr_lightning.seeding import keyed_uniform
from rlvr_lightning.training.batch import UpdateInputs, optimizer_step_norms
from rlvr_lightning.training.layout import Optimization, UpdateLayout
from rlvr_lightning.training.objective import Objective
from rlvr_lightning.training.step_metrics import MetricAccumulator

log = logging.getLogger(__name__)


class NonFiniteGuard:
    """Counts consecutive skipped updates across rollout batches; too many stop the run."""

    def __init__(self, max_streak: int) -> None:
        self.max_streak, self.streak = max_streak, 0

    def skipped(self, grad_norm: torch.Tensor) -> None:
        self.streak += 1
        log.warning("skipped an update with a non-finite gradient norm (%s)", grad_norm.item())
        if self.streak >= self.max_streak:
            raise RuntimeError(
                f"{self.streak} consecutive updates had a non-finite loss or gradient; stopping. "
                "Lower model.optim.lr or check the reward and the data."
            )


class PolicyUpdate:
    """Runs the update of one rollout batch: `objective`'s loss, laid out and stepped by `layout`."""

    def __init__(self, objective: Objective, layout: UpdateLayout, guard: NonFiniteGuard) -> None:
        self.objective, self.layout, self.guard = objective, layout, guard
        self.updates_since_rollout = 0  # optimizer steps taken since the rollout: 0 = θ is still θ_old
        self.step_key: tuple[int, ...] = (0,)  # names the optimizer step in the token selection's random draws
        self.token_entropy: torch.Tensor | None = None  # the last run's kept rows' entropy (`StepResult.token_entropy`)

    def run(self, step: StepContext, inputs: UpdateInputs, num_prompts: int, opt: Optimization) -> dict[str, float]:
        layout, G = self.layout, inputs.group_size
        acc = MetricAccumulator(kept_entropy_rows=step.entropy_groups * G)
        self.updates_since_rollout = 0
        for epoch in range(layout.ppo_epochs):
            # Mini-batches hold whole groups: prompt-level split, sequences stay group-contiguous.
            for mini_batch, prompt_idx in enumerate(torch.arange(num_prompts).chunk(layout.num_mini_batches)):
                rows = (prompt_idx[:, None] * G + torch.arange(G)).flatten().to(step.device)
                self.step_key = (step.seed, step.rollout_batch, epoch, mini_batch)
                opt.optimizer.zero_grad(set_to_none=True)
                acc.add("loss", self.accumulate_gradients(step, inputs, rows, opt.backward, acc))
                grad_norm = torch.nn.utils.clip_grad_norm_(opt.parameters(), layout.max_grad_norm)
                if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards
                    grad_norm = grad_norm.full_tensor()
                if not torch.isfinite(grad_norm):
                    opt.optimizer.zero_grad(set_to_none=True)
                    self.guard.skipped(grad_norm)
                    acc.add("skipped_updates", torch.tensor(1.0))
                    continue
                self.guard.streak = 0
                opt.optimizer.step()
                opt.scheduler.step()
                self.updates_since_rollout += 1
                acc.add("grad_norm", grad_norm.detach())
        metrics = acc.result()
        metrics["lr"] = opt.scheduler.get_last_lr()[0]
        self.token_entropy = acc.token_entropy()
        return metrics

    def accumulate_gradients(
        self,
        step: StepContext,
        inputs: UpdateInputs,
        rows: torch.Tensor,
        backward: Callable[[torch.Tensor], None],
        acc: MetricAccumulator | None = None,
    ) -> torch.Tensor:
        """Backward of one optimizer step's loss over the sequences `rows`; returns the step's loss."""
        norms = optimizer_step_norms(inputs, rows, step.collectives, self.layout.norm_const)
        if self.objective.two_pass:
            return self._two_pass(step, inputs, rows, norms, backward, acc)
        reads_lm_head = inputs.behaviour.reads_lm_head
        whole_groups = reads_lm_head or self.objective.needs_whole_groups
        if reads_lm_head and not self.layout.keeps_groups_whole(inputs.group_size):
            raise RuntimeError("advantage shapers read the update's LM-head inputs, but micro-batches split groups")
        step_loss = torch.zeros((), device=step.device)
        unit = inputs.group_size if whole_groups else 1
        selected = self.select_tokens(step, inputs, rows, acc)
        for idx in self.layout.micro_batches(rows, inputs.token_counts, step.collectives, unit):
            forward, mb = self.forward(step, inputs, idx, with_entropy=acc is not None, capture=reads_lm_head)
            mb_selected = None if selected is None else selected[idx, : mb.loss_mask.shape[1]]
            loss, stats = self.objective.micro_batch_loss(mb, forward.logp, norms, mb_selected, self.at_theta_old(inputs))
            backward(loss)
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask, idx)
                acc.add_padding(mb.tensors.attention_mask, packed=self.layout.packing)
            step_loss += loss.detach()  # already globally normalised: the step's loss is their sum
        return step_loss

    def at_theta_old(self, inputs: UpdateInputs) -> bool:
        """θ is still the θ_old of the loss's log-probs: no step since the rollout, and θ_old is the trainer's."""
        return self.updates_since_rollout == 0 and inputs.behaviour.source in ("trainer", "update", "proximal")

    def select_tokens(
        self, step: StepContext, inputs: UpdateInputs, rows: torch.Tensor, acc: MetricAccumulator | None
    ) -> torch.Tensor | None:
        """The loss's token selection over the optimizer step `rows`, [N, T] (False outside `rows`), or None.
        θ_old's log-probs are known before the update (`Objective.reads_step_first` keeps them so)."""
        select = self.objective.select
        if select is None:
            return None
        if inputs.behaviour.source == "update":
            raise RuntimeError("a token selection reads θ_old's log-probs before the update, not from its forwards")
        N, T = inputs.loss_mask.shape
        # This rank's first sequence in the step's global numbering: the sequences of the ranks before it.
        shares = torch.zeros(step.collectives.world_size, dtype=torch.float64)
        shares[step.collectives.rank] = N
        first = int(step.collectives.sum(shares)[: step.collectives.rank].sum())

        def uniform(local: torch.Tensor) -> torch.Tensor:  # keyed by (run seed, step, global sequence)
            return keyed_uniform(self.step_key, (first + rows[local]).tolist(), T).to(rows.device)

        old_logp = inputs.behaviour.old_logp_all()[rows]
        mask = inputs.loss_mask[rows]
        chosen, stats = select(TokenSelectionInputs(old_logp, inputs.advantages[rows], mask, uniform, step.collectives.sum))
        if acc is not None:
            acc.add_tokens(stats, None, mask)
        selected = torch.zeros_like(inputs.loss_mask, dtype=torch.bool)
        selected[rows] = chosen
        return selected

    def forward(
        self, step: StepContext, inputs: UpdateInputs, idx: torch.Tensor, with_entropy: bool = False, capture: bool = False
    ):
        """The policy's forward over the micro-batch `idx`, trimmed to its longest prompt and longest
        response (packed: its real tokens), and its loss batch."""
        forward = policy_forward(
            step.policy,
            inputs.tensors.select(idx).trimmed(),
            inputs.temperature,
            with_entropy=with_entropy,
            capture_lm_head=capture,
            chunk_tokens=self.layout.logprob_chunk_tokens,
            packed=self.layout.packing,
        )
        return forward, inputs.loss_batch(idx, forward, self.updates_since_rollout)

    def _two_pass(
        self, step: StepContext, inputs: UpdateInputs, rows: torch.Tensor, norms: OptimizerStepNorms, backward, acc
    ) -> torch.Tensor:
        objective = self.objective
        chunks = self.layout.micro_batches(rows, inputs.token_counts, step.collectives)
        # Where each micro-batch's sequences sit in `rows` (token budgets reorder them by length).
        position = torch.empty(int(rows.max()) + 1, dtype=torch.long, device=rows.device)
        position[rows] = torch.arange(len(rows), device=rows.device)
        correct, G = inputs.correct[rows], inputs.group_size
        # Pass 1: every s̄ of the step under the current θ. Groups never span ranks (each rank
        # generates its own prompts), so the local s̄ suffice; only the normaliser is global.
        s_bar = torch.zeros(len(rows), device=step.device)
        if not self.at_theta_old(inputs):  # θ = θ_old: s̄ ≡ 0
            with torch.no_grad():
                for idx in chunks:
                    s_bar[position[idx]] = self.sequence_log_ratio(step, inputs, idx)[0]
        step_loss, weights = objective.sequence_loss_and_weights(s_bar, correct, G, norms)
        # Pass 2: backpropagate sg[∂L/∂s̄_k]·s̄_k(θ) per micro-batch (× world size against gradient averaging).
        for idx in chunks:
            s_mb, mb, forward = self.sequence_log_ratio(step, inputs, idx, with_entropy=acc is not None)
            stats: dict[str, torch.Tensor] = {}
            kl = objective.kl_loss(mb, forward.logp, norms, stats)
            surrogate = (weights[position[idx]] * s_mb).sum() * norms.world_size
            backward(surrogate + kl)
            step_loss = step_loss + kl.detach()
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask, idx)
                acc.add_padding(mb.tensors.attention_mask, packed=self.layout.packing)
        if acc is not None:
            acc.add_tokens(objective.sequence_stats(s_bar, correct, G), None, inputs.loss_mask[rows])
        return step_loss

    def sequence_log_ratio(self, step: StepContext, inputs: UpdateInputs, rows: torch.Tensor, with_entropy: bool = False):
        """s̄ [n] of the sequences `rows` under the current θ, with their loss batch and forward."""
        forward, mb = self.forward(step, inputs, rows, with_entropy)
        return sequence_log_ratio(forward.logp, mb.old_logp, mb.loss_mask), mb, forward
