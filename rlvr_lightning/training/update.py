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
        if inputs.behaviour.reads_lm_head and m.hparams.micro_batch_size % inputs.group_size:
            raise RuntimeError("advantage shapers read the update's LM-head inputs, but micro-batches split groups")
        step_loss = torch.zeros((), device=m.device)
        for idx in self.micro_batches(rows):
            forward = policy_forward(
                m.policy, inputs.tensors.select(idx), inputs.temperature, with_entropy=acc is not None,
                capture_lm_head=inputs.behaviour.reads_lm_head,
            )  # fmt: skip
            mb = inputs.loss_batch(idx, forward)
            loss, stats = m.micro_batch_loss(mb, forward.logp, norms)
            m.manual_backward(loss)
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask)
            step_loss += loss.detach()  # already globally normalised: the step's loss is their sum
        return step_loss

    def micro_batches(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(rows.split(self.module.hparams.micro_batch_size))

    def _two_pass(self, inputs: UpdateInputs, rows: torch.Tensor, norms: StepNorms, acc) -> torch.Tensor:
        m = self.module
        chunks = self.micro_batches(rows)
        correct, G = inputs.correct[rows], inputs.group_size
        # Pass 1: every s̄ of the step under the current θ. Groups never span ranks (each rank
        # generates its own prompts), so the local s̄ suffice; only the normaliser is global.
        if self.updates_since_rollout == 0 and inputs.behaviour.source == "trainer":
            s_bar = torch.zeros(len(rows), device=m.device)  # θ = θ_old: s̄ ≡ 0 exactly
        else:
            with torch.no_grad():
                s_bar = torch.cat([self.sequence_log_ratio(inputs, idx)[0] for idx in chunks])
        step_loss, weights = m.sequence_loss_and_weights(s_bar, correct, G, norms)
        # Pass 2: backpropagate sg[∂L/∂s̄_k]·s̄_k(θ) per micro-batch (× world size against gradient averaging).
        offset = 0
        for idx in chunks:
            s_mb, mb, forward = self.sequence_log_ratio(inputs, idx, with_entropy=acc is not None)
            stats: dict[str, torch.Tensor] = {}
            kl = m.kl_loss(mb, forward.logp, norms, stats)
            surrogate = (weights[offset : offset + len(idx)] * s_mb).sum() * norms.world_size
            m.manual_backward(surrogate + kl)
            step_loss = step_loss + kl.detach()
            offset += len(idx)
            if acc is not None:
                acc.add_tokens(stats, forward.entropy, mb.loss_mask)
        if acc is not None:
            acc.add_tokens(m.sequence_stats(s_bar, correct, G), None, inputs.loss_mask[rows])
        return step_loss

    def sequence_log_ratio(self, inputs: UpdateInputs, rows: torch.Tensor, with_entropy: bool = False):
        """s̄ [n] of the sequences `rows` under the current θ, with their loss batch and forward."""
        forward = policy_forward(self.module.policy, inputs.tensors.select(rows), inputs.temperature, with_entropy)
        mb = inputs.loss_batch(rows, forward)
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
