"""Rollouts generated ahead of the trainer with bounded staleness (`rollout.stream.max_staleness: s`), optionally
as partial rollouts (`rollout.stream.partial_rollouts`), on a schedule that is a function of the step alone.

The schedule (the reproducible mode: what is generated under which policy version, and where a sequence
is interrupted, depend on the seed and the step, never on timing). At step t the servers hold version v
(the weights synced after step t − 1); the trainer takes rollout batch t, which is complete, and while it
scores and updates, the servers run in the background, all under v:
  - every batch t + j (1 ≤ j ≤ s, not past the run's last) not yet started starts now: it has j versions
    (v … v + j − 1) before step t + j needs it;
  - every started batch runs its next segment.
Without partial rollouts a batch's one segment generates it whole under the version it started at, so batch
t + s is sampled by version t: staleness exactly s (less for the first s batches). With partial rollouts a
batch of n versions runs n segments: segment i generates each unfinished sequence up to ⌈L·(i+1)/n⌉ of its
L = max_response_length tokens, so the interrupted sequences continue under each newer version from where
they stopped; a token sampled by version u trains at version t: its staleness t − u is between 1 and s.
Every token keeps the version that sampled it and that version's log-prob (`Completion.versions`,
`Completion.logprobs`): the behaviour policy is exact per token.

Before the weight sync the trainer waits for the background work (`wait`): the servers change weights only
between segments. So between steps nothing runs, and the batches in flight are data (tokens, log-probs,
versions): they go into the checkpoint (`state_dict`) and a resumed run continues them as the uninterrupted
run would. `max_staleness: 0` never builds a stream (the step generates its batch itself); `1` is one batch
generated ahead by the previous version, whole.

In an environment (answers in turns, `environments.episodes`) a batch's sequences are episodes: a segment takes
each unfinished one on, turn after turn with the environment's replies between, to the segment's cap; a turn cut
at the cap goes on in the next segment (`advance_episodes`). Replies run inside a segment, so never during a
weight sync, and the episodes in flight (their calls and notes too) are data like the rest.

Seeds: a batch's first segment samples with its rollout batch's seed, as the synchronous step would
(`sampling_seed`); segment i > 0 with stream SEGMENT_STREAM + i of that batch (`derived_seed`), one request
per unfinished sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from rlvr_lightning.context import StepContext
from rlvr_lightning.environments.episodes import Episode, advance_episodes, start_episodes
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.seeding import derived_seed
from rlvr_lightning.training.generation import (
    encode_prompts,
    episodes_rollout,
    sampling_seed,
    score_rollout,
    to_rollout,
)
from rlvr_lightning.training.step_metrics import StageTimer

SEGMENT_STREAM = 1000  # derived_seed streams of continuation segments (DAPO's rounds use the small ones)


@dataclass
class InFlightBatch:
    """One rollout batch being generated: its prompts, its sequences so far and its schedule."""

    index: int  # the rollout batch it is
    batch: PromptBatch
    prompt_ids: list[list[int]]
    sampling: SamplingConfig  # the whole batch's (its rollout batch's seed, L tokens)
    start_version: int
    segments: int  # versions it is generated under (1 without partial rollouts)
    done: int = 0  # segments generated
    sequences: list[Completion] = field(default_factory=list)  # B·G, group-contiguous, after the first segment
    episodes: list[Episode] = field(default_factory=list)  # the same in an environment (answers in turns)
    seconds: float = 0.0  # its segments' generation time (each beside the update and other batches' segments)

    @property
    def complete(self) -> bool:
        return self.done == self.segments

    def cap(self, segment: int) -> int:
        """Tokens a sequence may have after `segment`: ⌈L·(segment+1)/segments⌉."""
        return math.ceil(self.sampling.max_tokens * (segment + 1) / self.segments)

    def unfinished(self) -> list[int]:
        """Sequences the next segment continues: neither stopped nor at the previous segment's cap."""
        previous = self.cap(self.done - 1)
        return [n for n, c in enumerate(self.sequences) if c.finish_reason == "length" and len(c.token_ids) == previous]


def dataloader_batch(step: StepContext, index: int) -> PromptBatch:
    return step.prompts.batch_at(index)


class RolloutStream:
    """`prompts(step, index)`: what rollout batch `index` generates, called once per batch, in batch order, when
    it starts; its first prompts are the dataloader's batch (DAPO adds its first round's extra prompts)."""

    def __init__(
        self,
        max_staleness: int,
        partial_rollouts: bool,
        prompts: Callable[[StepContext, int], PromptBatch] = dataloader_batch,
    ) -> None:
        if max_staleness < 1:
            raise ValueError("a rollout stream generates ahead: max_staleness ≥ 1")
        self.max_staleness, self.partial_rollouts, self.prompts = max_staleness, partial_rollouts, prompts
        self.pool = ThreadPoolExecutor(max_workers=max_staleness, thread_name_prefix="rollout-ahead")
        self.in_flight: dict[int, InFlightBatch] = {}
        self.work: list[Future] = []
        self._saved_episodes = False  # the batches in flight hold a checkpoint's episodes, as saved

    # ---- the step's view -------------------------------------------------------------------------------
    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer) -> Rollout:
        """Rollout batch `step.rollout_batch`, scored; starts the background work of this step's version."""
        k = step.rollout_batch
        self.wait(timer)  # normally done already: the last sync waited for it
        self._restore_episodes(step)
        timer.times.setdefault("rollout_wait", 0.0)  # every step of a stream logs it, the last one too
        current = self.in_flight.pop(k, None)
        if current is None:  # the first step (or a checkpoint without a stream): generated now, whole
            current = self._new(step, self.prompts(step, k), k, segments=1)
            with timer("rollout_wait"):
                self._segment(step, current)
        if current.batch.ids[: len(batch)] != batch.ids:
            raise RuntimeError(f"rollout batch {k} in flight holds other prompts than the dataloader's batch {k}")
        # The batch's own generation time, overlapped or not (`rollout_wait` is what the step waited).
        timer.times["rollout"] = timer.times.get("rollout", 0.0) + current.seconds
        if not current.complete:
            raise RuntimeError(f"rollout batch {k} is needed but {current.segments - current.done} segments are left")
        self._start_background(step)
        G = current.sampling.group_size
        made = (current.batch, current.prompt_ids, current.sampling)
        if current.episodes:
            groups = [current.episodes[g * G : (g + 1) * G] for g in range(len(current.batch))]
            rollout = episodes_rollout(step.tokenizer, *made, groups, current.start_version, step.environment)
        else:
            groups = [current.sequences[g * G : (g + 1) * G] for g in range(len(current.batch))]
            rollout = to_rollout(step.tokenizer, *made, groups, current.start_version)
        return score_rollout(step, rollout, timer)

    def wait(self, timer: StageTimer) -> None:
        """Block until this version's segments are generated: the servers' weights may change only then."""
        if self.work:
            with timer("rollout_wait"):
                work, self.work = self.work, []
                for f in work:
                    f.result()  # an engine error surfaces here

    def synced(self, version: int) -> None:
        """The servers hold `version` now (each segment reads the step's version itself)."""

    def describe(self) -> str:
        """The batches in flight and their segments done, for the watchdog's report."""
        batches = ", ".join(f"batch {k}: {b.done}/{b.segments} segments" for k, b in sorted(self.in_flight.items()))
        running = sum(not f.done() for f in self.work)
        return f"reproducible, {self.max_staleness} ahead; in flight: {batches or 'none'}; {running} segment(s) generating"

    def close(self) -> None:
        for f in self.work:
            f.cancel()
        self.work = []
        self.pool.shutdown(wait=True, cancel_futures=True)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches in flight (between steps nothing is being generated)."""
        if self.work:
            raise RuntimeError("the rollout stream is saved while a segment is being generated")
        return {
            "max_staleness": self.max_staleness,
            "partial_rollouts": self.partial_rollouts,
            "in_flight": [asdict(b) for b in self.in_flight.values()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved batches if this run streams as the saved one did; else start afresh (the
        first step after resume then generates its batch itself)."""
        same = (state.get("max_staleness"), state.get("partial_rollouts")) == (self.max_staleness, self.partial_rollouts)
        self.in_flight = {}
        if not same:
            return
        for b in state.get("in_flight", []):
            b = dict(b)
            b["batch"] = PromptBatch(**b["batch"])
            b["sampling"] = SamplingConfig(**b["sampling"])
            b["sequences"] = [Completion.from_state(c) for c in b["sequences"]]
            self.in_flight[b["index"]] = InFlightBatch(**b)  # its episodes stay dicts until `_restore_episodes`
        self._saved_episodes = any(b.episodes for b in self.in_flight.values())

    def _restore_episodes(self, step: StepContext) -> None:
        """A checkpoint's episodes, rebuilt by the step's environment (which rebuilds its calls)."""
        if self._saved_episodes:
            for b in self.in_flight.values():
                b.episodes = [Episode.from_state(e, step.environment) for e in b.episodes]
            self._saved_episodes = False

    # ---- the schedule ---------------------------------------------------------------------------------
    def _new(self, step: StepContext, batch: PromptBatch, index: int, segments: int) -> InFlightBatch:
        sampling = step.sampling(seed=sampling_seed(step, rollout_batch=index))
        return InFlightBatch(index, batch, encode_prompts(step.tokenizer, batch), sampling, step.policy_version, segments)

    def _start_background(self, step: StepContext) -> None:
        """Start the batches this version is the first of, then run one segment of every batch in flight."""
        k = step.rollout_batch
        for j in range(1, self.max_staleness + 1):
            index = k + j
            if index >= step.total_rollout_batches or index in self.in_flight:
                continue
            segments = j if self.partial_rollouts else 1
            self.in_flight[index] = self._new(step, self.prompts(step, index), index, segments)
        pending = [b for b in sorted(self.in_flight.values(), key=lambda b: b.index) if not b.complete]
        if getattr(step.engine, "concurrent_requests", False):  # the segments share the servers' batches
            self.work += [self.pool.submit(self._segment, step, b) for b in pending]
        elif pending:  # an engine whose calls must not overlap (one process's RNG): one after the other
            self.work.append(self.pool.submit(lambda: [self._segment(step, b) for b in pending]))

    def _segment(self, step: StepContext, b: InFlightBatch) -> None:
        """Generate segment `b.done` of batch `b` under the version the engine holds now."""
        started = time.perf_counter()
        version, cap = step.policy_version, b.cap(b.done)
        if step.environment is not None:
            self._episodes_segment(step, b, version, cap)
        elif b.done == 0:
            groups = step.engine.generate(b.prompt_ids, replace(b.sampling, max_tokens=cap))
            b.sequences = [with_version(c, version) for group in groups for c in group]
        else:
            rows = b.unfinished()
            if rows:
                G, previous = b.sampling.group_size, b.cap(b.done - 1)
                prompts = [b.prompt_ids[n // G] + b.sequences[n].token_ids for n in rows]
                seed = derived_seed(step.seed, b.index, SEGMENT_STREAM + b.done, step.collectives.rank)
                sampling = replace(b.sampling, group_size=1, max_tokens=cap - previous, seed=seed)
                for n, (more,) in zip(rows, step.engine.generate(prompts, sampling), strict=True):
                    b.sequences[n] = extended(b.sequences[n], more, version)
        b.done += 1
        b.seconds += time.perf_counter() - started

    def _episodes_segment(self, step: StepContext, b: InFlightBatch, version: int, cap: int) -> None:
        """In an environment: every unfinished episode goes on, turn after turn, to `cap` response tokens (a turn
        cut there, or a reply that reaches it, goes on in the next segment, under the next version)."""
        sampling = b.sampling
        if b.done == 0:
            b.episodes = start_episodes(b.prompt_ids, sampling.group_size, b.batch)
        else:
            seed = derived_seed(step.seed, b.index, SEGMENT_STREAM + b.done, step.collectives.rank)
            sampling = replace(sampling, seed=seed)
        advance_episodes(step.engine.generate, step.tokenizer, b.episodes, sampling, step.environment, cap, version)


def with_version(c: Completion, version: int) -> Completion:
    return replace(c, versions=[version] * len(c.token_ids))


def extended(c: Completion, more: Completion, version: int) -> Completion:
    """Sequence `c` continued by `more`, generated under `version`."""
    return Completion(
        c.token_ids + more.token_ids,
        c.logprobs + more.logprobs,
        more.finish_reason,
        c.versions + [version] * len(more.token_ids),
    )
