"""One training step as a plain object, read top to bottom in `TrainingStep.run`:
collect a scored rollout → rewards, advantages → θ_old, token weights (`prepare_update`) → update →
weight sync. It is built once, from plain values (`training.step_setup`); the LightningModule runs it each rollout
batch and logs what it returns.

What an algorithm changes in the step's structure (DAPO's reward shaping and dynamic sampling) is a
`StepAlgorithm`, a small object the module hands in, not an override of the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.pieces.kinds import AdvantageInputs
from rlvr_lightning.rollout.types import PromptBatch, Rollout
from rlvr_lightning.training.algorithm import BoundPieces
from rlvr_lightning.training.batch import UpdateInputs
from rlvr_lightning.training.engine_session import EngineSession, Stream
from rlvr_lightning.training.generation import generate_and_score
from rlvr_lightning.training.layout import Optimization, UpdateLayout
from rlvr_lightning.training.prepare import prepare_update
from rlvr_lightning.training.settings import ResolvedStep
from rlvr_lightning.training.shaping import shaper_metrics
from rlvr_lightning.training.step_metrics import StageTimer, StepResult, step_metrics
from rlvr_lightning.training.teacher import distillation_inputs
from rlvr_lightning.training.update import NonFiniteGuard, PolicyUpdate


@dataclass(frozen=True)
class Skipped:
    """A rollout batch with nothing to learn from (DAPO: no group of mixed correctness): its metrics, and
    whether the run should stop."""

    metrics: dict[str, float]
    stop_run: bool = False


class StepAlgorithm:
    """What an algorithm changes in the structure of the step. This one changes nothing (GRPO's step): the
    reward is the verifier's verdict (r = c), a rollout batch generates the dataloader's prompts, and its
    rollout is generated now, or taken from the stream generating ahead (`rollout.stream.max_staleness`)."""

    def rewards(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward r [N] fed to the advantage estimator, and its metrics: the verdict c, plus the reward terms of
        a user's reward functions (`model.rewards.functions`) if any."""
        return rollout.reward_with_terms(rollout.correct.clone()), {}

    def prompts(self, step: StepContext, index: int) -> PromptBatch:
        """The prompts rollout batch `index` generates (the stream asks ahead of the dataloader)."""
        return step.prompts.batch_at(index)

    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer, stream: Stream | None) -> Rollout | Skipped:
        """The scored rollout to train on (`batch`: the dataloader's prompts)."""
        return stream.collect(step, batch, timer) if stream is not None else generate_and_score(step, batch, timer)


@dataclass(frozen=True)
class TrainingStep:
    algorithm: StepAlgorithm
    resolved: ResolvedStep  # the bound pieces, the update's layout, where θ_old comes from
    mask_truncated: bool  # leave completions cut at max_response_length out of the loss
    shapers: Sequence[AdvantageShaper]  # THR, OAR: token weights on the advantages
    nonfinite: NonFiniteGuard  # the streak of non-finite updates, across rollout batches
    session: EngineSession  # the engine, the weight sync, the stream
    rollout_settings: Any  # the `rollout:` section (its stream settings)

    @property
    def pieces(self) -> BoundPieces:
        """The advantage estimator, the objective, the rollout correction, the proximal policy."""
        return self.resolved.pieces

    @property
    def layout(self) -> UpdateLayout:
        return self.resolved.layout

    @property
    def stream(self) -> Stream | None:
        if self.rollout_settings.stream.max_staleness <= 0:
            return None
        return self.session.rollout_stream(self.rollout_settings, self.algorithm.prompts)

    @property
    def update(self) -> PolicyUpdate:
        """The update of this rollout batch (the non-finite streak carries across batches)."""
        return PolicyUpdate(self.pieces.objective, self.layout, self.nonfinite)

    def run(self, step: StepContext, batch: PromptBatch, optimization: Optimization) -> StepResult | Skipped:
        """Train on rollout batch `step.rollout_batch`, whose dataloader prompts are `batch`."""
        timer = StageTimer()
        rollout = self.algorithm.collect(step, batch, timer, self.stream)
        if isinstance(rollout, Skipped):
            return rollout
        step.engine.release_memory()  # vLLM sleep mode (rollout.sleep_level); the weight sync wakes it
        scored, inputs, prepare_metrics = self.prepare(step, rollout, timer)
        update = self.update
        with timer("update"):
            update_metrics = update.run(step, inputs, len(rollout.batch), optimization)
        self.session.sync_weights(rollout, timer)
        behaviour_metrics = getattr(inputs.behaviour, "metrics", dict)()  # a correction read in the update's forwards
        metrics = {
            **update_metrics,
            **prepare_metrics,
            **behaviour_metrics,
            **shaper_metrics(self.shapers),
            **rollout.staleness(step.policy_version),
            **getattr(step.engine, "fault_counts", dict)(),  # servers: replicas restarted, requests sent again
        }
        return StepResult(scored, inputs, inputs.token_weights(), metrics, timer.finish(), update.token_entropy)

    def prepare(
        self, step: StepContext, rollout: Rollout, timer: StageTimer | None = None
    ) -> tuple[ScoredBatch, UpdateInputs, dict[str, float]]:
        """The scored batch, the update's inputs, and the reward's, advantages' and correction's metrics."""
        timer = timer or StageTimer()
        rewards, reward_metrics = self.algorithm.rewards(rollout)
        tensors = rollout.tensors(step.tokenizer.pad_token_id).to(step.device)  # laid out once, for the teacher too
        distillation = None
        if step.teacher is not None:
            with timer("teacher"):
                distillation = distillation_inputs(step.teacher, step, rollout, tensors, self.layout)
        inputs = AdvantageInputs(
            rewards, rollout.correct, rollout.group_size, step.collectives.sum, rollout.response_lengths, distillation
        )
        advantages, token_advantages, advantage_metrics = self.pieces.advantages(inputs)
        scored = ScoredBatch(rollout, rewards, advantages, token_advantages)
        update_inputs, correction_metrics = prepare_update(
            step,
            scored,
            tensors,
            self.layout,
            self.resolved.behaviour,
            self.pieces.correct,
            self.mask_truncated,
            list(self.shapers),
            timer,
            self.pieces.approximate_proximal,
        )
        return scored, update_inputs, {**reward_metrics, **advantage_metrics, **correction_metrics}


def logged_metrics(result: StepResult | Skipped, session: EngineSession) -> dict[str, float]:
    """What one rollout batch logs: a skipped batch's own metrics, or a trained one's `train/`, `time/` and
    `throughput/` metrics (`step_metrics`)."""
    if isinstance(result, Skipped):
        return {f"train/{k}": v for k, v in result.metrics.items()}
    return step_metrics(
        result.batch,
        result.inputs.tensors,
        result.inputs.behaviour.old_logp_all(),
        result.metrics,
        result.times,
        session.policy_version,
        session.sync.probe.last_diff,
    )
