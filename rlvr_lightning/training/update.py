"""The policy update of one rollout batch: `ppo_epochs` passes of `mini_batches` optimizer steps, each
accumulating the gradient of its loss over micro-batches, then clipping and stepping.

Every micro-batch loss is divided by the optimizer step's global counts (`StepNorms`), so the
accumulated gradient is the same for any micro-batch size and any number of ranks. Two ways to
accumulate:
  - micro-batches (default): forward, the algorithm's `micro_batch_loss`, backward, per micro-batch;
  - two-pass, for losses of per-sequence scalars that couple a group's rollouts (REAL) when micro-batches
    split groups: pass 1 computes every sequence's s̄ without grad, the algorithm's closed-form
    ∂L/∂s̄ gives each sequence a weight, pass 2 backpropagates weight · s̄ micro-batch by micro-batch —
    the same gradient for one extra forward.
An optimizer step whose gradient norm is not finite is skipped (weights and optimizer state
untouched); `max_nonfinite_steps` in a row stop the run.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from rlvr_lightning.losses import sequence_log_ratio
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.training.batch import StepNorms, UpdateInputs, step_norms
from rlvr_lightning.training.micro_batches import keeps_groups_whole, split_rows
from rlvr_lightning.training.step_metrics import MetricAccumulator

log = logging.getLogger(__name__)


class PolicyUpdate:
    """Runs the update for an `RLVRModule`, whose algorithm supplies the loss (`micro_batch_loss`, and
    for two-pass accumulation `sequence_loss_and_weights`, `sequence_stats` and `kl_loss`)."""

    def __init__(self, module) -> None:
        self.module = module
        self.updates_since_rollout = 0  # optimizer steps taken since the rollout: 0 = θ is still θ_old
        self.nonfinite_streak = 0

    def run(self, inputs: UpdateInputs, num_prompts: int) -> dict[str, float]:
        m = self.module
        h = m.hparams
        opt, sched = m.optimizers(), m.lr_schedulers()
        G = inputs.group_size
        acc = MetricAccumulator()
        self.updates_since_rollout = 0
        for _epoch in range(h.ppo_epochs):
            # Mini-batches hold whole groups: prompt-level split, sequences stay group-contiguous.
            for prompt_idx in torch.arange(num_prompts).chunk(h.mini_batches):
                rows = (prompt_idx[:, None] * G + torch.arange(G)).flatten().to(m.device)
                opt.zero_grad(set_to_none=True)
                acc.add("loss", self.accumulate_gradients(inputs, rows, acc))
                grad_norm = torch.nn.utils.clip_grad_norm_(m.policy.parameters(), h.max_grad_norm)
                if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards
                    grad_norm = grad_norm.full_tensor()
                if not torch.isfinite(grad_norm):
                    self._skip(opt, grad_norm)
                    acc.add("skipped_updates", torch.tensor(1.0))
                    continue
                self.nonfinite_streak = 0
                opt.step()
                sched.step()
                self.updates_since_rollout += 1
                acc.add("grad_norm", grad_norm.detach())
        metrics = acc.result()
        metrics["lr"] = sched.get_last_lr()[0]
        return metrics

    def accumulate_gradients(
        self, inputs: UpdateInputs, rows: torch.Tensor, acc: MetricAccumulator | None = None
    ) -> torch.Tensor:
        """Backward of one optimizer step's loss over the sequences `rows`; returns the step's loss."""
        m = self.module
        norms = step_norms(
            inputs, rows, lambda x: m.trainer.strategy.reduce(x, reduce_op="sum"), m.trainer.world_size,
            float(m.datamodule.hparams.max_response_length),
        )  # fmt: skip
        if m.two_pass:
            return self._two_pass(inputs, rows, norms, acc)
        whole_groups = inputs.behaviour.reads_lm_head or m.needs_whole_groups
        h = m.hparams
        if inputs.behaviour.reads_lm_head and not keeps_groups_whole(h.micro_batch_size, h.max_tokens_per_micro_batch, inputs.group_size):
            raise RuntimeError("advantage shapers read the update's LM-head inputs, but micro-batches split groups")
        step_loss = torch.zeros((), device=m.device)
        for idx in self.micro_batches(rows, inputs.lengths, inputs.group_size if whole_groups else 1):
            forward, mb = self.forward(inputs, idx, with_entropy=acc is not None, capture=inputs.behaviour.reads_lm_head)
            loss, stats = m.micro_batch_loss(mb, forward.logp, norms)
            m.manual_backward(loss)
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask)
                acc.add_padding(mb.tensors.attention_mask)
            step_loss += loss.detach()  # already globally normalised: the step's loss is their sum
        return step_loss

    def micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor, unit: int = 1) -> list[torch.Tensor]:
        """The micro-batches of `rows` (see `training.micro_batches`), the same count on every rank;
        `unit` = G keeps groups whole."""
        h = self.module.hparams
        return split_rows(rows, lengths, h.micro_batch_size, h.max_tokens_per_micro_batch, unit, self.agree_count)

    def agree_count(self, count: int) -> int:
        """The number of micro-batches every rank runs: the largest any rank needs."""
        return self.module.across_ranks(count, op="max")

    def forward(self, inputs: UpdateInputs, idx: torch.Tensor, with_entropy: bool = False, capture: bool = False):
        """The policy's forward over the micro-batch `idx`, trimmed to its longest row, and its loss batch."""
        forward = policy_forward(
            self.module.policy, inputs.tensors.select(idx).trimmed(), inputs.temperature, with_entropy=with_entropy,
            capture_lm_head=capture, chunk_tokens=self.module.hparams.logprob_chunk_tokens,
        )  # fmt: skip
        return forward, inputs.loss_batch(idx, forward)

    def _two_pass(self, inputs: UpdateInputs, rows: torch.Tensor, norms: StepNorms, acc) -> torch.Tensor:
        m = self.module
        chunks = self.micro_batches(rows, inputs.lengths)
        # Where each micro-batch's sequences sit in `rows` (token budgets reorder them by length).
        position = torch.empty(int(rows.max()) + 1, dtype=torch.long, device=rows.device)
        position[rows] = torch.arange(len(rows), device=rows.device)
        correct, G = inputs.correct[rows], inputs.group_size
        # Pass 1: every s̄ of the step under the current θ. Groups never span ranks (each rank
        # generates its own prompts), so the local s̄ suffice; only the normaliser is global.
        s_bar = torch.zeros(len(rows), device=m.device)
        if not (self.updates_since_rollout == 0 and inputs.behaviour.source == "trainer"):  # θ = θ_old: s̄ ≡ 0
            with torch.no_grad():
                for idx in chunks:
                    s_bar[position[idx]] = self.sequence_log_ratio(inputs, idx)[0]
        step_loss, weights = m.sequence_loss_and_weights(s_bar, correct, G, norms)
        # Pass 2: backpropagate sg[∂L/∂s̄_k]·s̄_k(θ) per micro-batch (× world size against gradient averaging).
        for idx in chunks:
            s_mb, mb, forward = self.sequence_log_ratio(inputs, idx, with_entropy=acc is not None)
            stats: dict[str, torch.Tensor] = {}
            kl = m.kl_loss(mb, forward.logp, norms, stats)
            surrogate = (weights[position[idx]] * s_mb).sum() * norms.world_size
            m.manual_backward(surrogate + kl)
            step_loss = step_loss + kl.detach()
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask)
                acc.add_padding(mb.tensors.attention_mask)
        if acc is not None:
            acc.add_tokens(m.sequence_stats(s_bar, correct, G), None, inputs.loss_mask[rows])
        return step_loss

    def sequence_log_ratio(self, inputs: UpdateInputs, rows: torch.Tensor, with_entropy: bool = False):
        """s̄ [n] of the sequences `rows` under the current θ, with their loss batch and forward."""
        forward, mb = self.forward(inputs, rows, with_entropy)
        return sequence_log_ratio(forward.logp, mb.old_logp, mb.loss_mask), mb, forward

    def _skip(self, opt, grad_norm: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        self.nonfinite_streak += 1
        log.warning("skipped an update with a non-finite gradient norm (%s)", grad_norm.item())
        if self.nonfinite_streak >= self.module.hparams.max_nonfinite_steps:
            raise RuntimeError(
                f"{self.nonfinite_streak} consecutive updates had a non-finite loss or gradient; stopping. "
                "Lower model.lr or check the reward and the data."
            )
