"""Rollouts one batch ahead (`rollout.batches_ahead: 1`): rollout batch k+1 is generated on the
rollout servers while this process updates the policy on batch k.

Step k: take batch k's rollout (started during step k−1, by policy version k−1), start batch k+1 with
the weights the servers hold now (version k), score and train on batch k, wait for batch k+1's
generation to finish, then sync version k+1. So every rollout but the first is one version behind the
policy it trains (`train/batches_ahead` = 1); the update corrects for it with θ_old = the engine's
log-probs (exact off-policy PPO), or with the trainer's θ_old and truncated importance sampling when
`model.rollout_correction` is set. Batch k+1 is the dataloader's own batch k+1 (the prompt stream is a pure
function of the step, `ResumableBatches.batch_at`), generated one step early.

A resumed run starts without a batch in flight: its first step generates synchronously.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from rlvr_lightning.context import StepContext
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.generation import encode_prompts, sampling_seed, score_rollout, to_rollout
from rlvr_lightning.training.step_metrics import StageTimer


@dataclass
class InFlight:
    index: int  # the rollout batch it is for
    batch: PromptBatch
    prompt_ids: list[list[int]]
    sampling: SamplingConfig
    policy_version: int  # the weights the servers held when it started
    future: Future  # → (completion groups, seconds the generation took)


class RolloutsAhead:
    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.in_flight: InFlight | None = None

    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer) -> Rollout:
        k = step.rollout_batch
        ahead, self.in_flight = self.in_flight, None
        if ahead is not None and (ahead.index != k or ahead.batch.ids != batch.ids):
            ahead.future.cancel()  # not the batch this step got (cannot happen unless the stream moved)
            ahead = None
        if ahead is None:
            ahead = self._start(step, batch, k)
        with timer("rollout_wait"):
            groups, seconds = ahead.future.result()
        timer.times["rollout"] = timer.times.get("rollout", 0.0) + seconds  # its own duration, overlapped or not
        if k + 1 < step.total_rollout_batches:  # no generation past the run's last rollout batch
            self.in_flight = self._start(step, step.data.train_batch_at(k + 1), k + 1)
        rollout = to_rollout(step, ahead.batch, ahead.prompt_ids, ahead.sampling, groups, ahead.policy_version)
        return score_rollout(step, rollout, timer)

    def _start(self, step: StepContext, batch: PromptBatch, index: int) -> InFlight:
        sampling = step.sampling(seed=sampling_seed(step, rollout_batch=index))
        prompt_ids = encode_prompts(step, batch)
        engine = step.engine

        def run():
            start = time.perf_counter()
            groups = engine.generate(prompt_ids, sampling)
            return groups, time.perf_counter() - start

        return InFlight(index, batch, prompt_ids, sampling, step.policy_version, self.pool.submit(run))

    def wait(self, timer: StageTimer) -> None:
        """Block until the batch in flight is generated: the servers' weights may change only then."""
        if self.in_flight is not None:
            with timer("rollout_wait"):
                self.in_flight.future.exception()  # waits; an error surfaces when the batch is taken

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.future.cancel()
            self.in_flight = None
        self.pool.shutdown(wait=True, cancel_futures=True)
