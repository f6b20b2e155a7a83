"""The throughput mode of the rollout stream (`rollout.stream.mode: throughput`): groups are generated
continuously and trained in the order they finish. Which groups a step trains depends on timing, so two
runs with the same seed differ; `stream.mode: reproducible` (`rollout_stream.py`) is the mode that does not.

The servers always have work: the stream keeps up to (s + 1)·B groups issued and not yet trained (s·B
between a step taking its groups and the weight sync; one request per prompt, G samples; B groups per
step, s = `rollout.stream.max_staleness`), taking prompts in the dataloader's order, batch after batch. With partial rollouts a weight sync freezes the requests in flight
(vLLM's `/pause?mode=keep`) and they continue under the new weights; vLLM reports which version sampled
each token (its weight-version spans), so each token keeps its version and log-prob. Their KV cache, kept
from the old weights, is not recomputed: the log-prob vLLM reports is that of the distribution it sampled
from, so the behaviour policy stays exact. Without partial rollouts the sync waits for the requests in
flight (`mode=wait`) and every group is sampled by one version.

A group issued at version u must train by step u + s (its deadline). What happens to one that would not
is `rollout.stream.stale_groups`:
  - `hold`: nothing is dropped. A step takes first the groups that later steps could not all train by
    their deadlines (earliest deadline first, waiting for them to finish), then the earliest finished.
    With that many outstanding, every group trains in time (`must_train_now`, `_can_issue`).
  - `drop`: a step takes the B earliest finished; a group past its deadline, finished or not, is dropped
    and its prompt issued again under the current version. Dropping favours what finishes first, so
    short answers: `train/groups_dropped` and `train/dropped_response_length_mean` (beside
    `train/response_length_mean`) show how much.

In an environment a group's answers go turn by turn (`environments.episodes`), each turn a request of its own: a
sync may fall between two turns (while the tool runs; the episode goes on under the new weights) or freeze one;
every token keeps the version the servers report for it, and an inserted reply that of the token before it.

Checkpoints keep the finished groups (with their episodes) and the prompts not yet trained; groups still being
generated are issued again on resume.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial

from rlvr_lightning.context import StepContext
from rlvr_lightning.environments.episodes import Episode, advance_episodes, start_episodes
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout
from rlvr_lightning.seeding import derived_seed
from rlvr_lightning.training.generation import encode_prompts, episodes_rollout, score_rollout, to_rollout
from rlvr_lightning.training.step_metrics import StageTimer

GROUP_STREAM = 3000  # derived_seed streams of the throughput mode's requests (attempt a of a prompt: + a)
MAX_REQUEST_THREADS = 256  # groups beyond it wait for a thread (their requests queue here, not at the server)


@dataclass(eq=False)  # a group is itself: two with the same fields are still two requests
class Group:
    """One prompt's G samples: where the prompt came from, the version its request was issued under."""

    source: tuple[int, int]  # (rollout batch, position in it): the dataloader's prompt
    prompt: PromptBatch  # that one prompt
    prompt_ids: list[int]
    issued: int  # the servers' version when it was issued
    attempt: int = 0  # times it was issued before (dropped)
    completions: list[Completion] | None = None  # None while it is generated
    episodes: list[Episode] = field(default_factory=list)  # in an environment: its answers in turns, once generated
    finished: int = -1  # the order it finished in
    seconds: float = 0.0  # its request's time
    dropped: bool = False  # past its deadline (`drop`): trained never, its prompt issued again

    @property
    def ready(self) -> bool:
        return self.completions is not None

    def to_issue(self, attempt: int) -> Group:
        """This group's prompt, to be issued (again): nothing generated, no version yet."""
        return Group(self.source, self.prompt, self.prompt_ids, issued=-1, attempt=attempt)


def must_train_now(deadlines: list[int], step: int, per_step: int) -> int:
    """How many of the outstanding groups (their deadlines) step `step` must train, earliest deadline first,
    so that steps step+1, step+2, … taking `per_step` groups each can train every other group by its
    deadline: max over d of |{deadline ≤ d}| − (d − step)·per_step."""
    need = 0
    for d in sorted(set(deadlines)):
        need = max(need, sum(x <= d for x in deadlines) - max(0, d - step) * per_step)
    return need


def choose(groups: list[Group], step: int, max_staleness: int, per_step: int, hold: bool) -> list[Group] | None:
    """The groups step `step` trains, or None while it must wait for more to finish. `hold`: the ones
    `must_train_now` names (earliest deadline; among equal deadlines the finished first), then the earliest
    finished; else the earliest finished."""
    by_finish = sorted((g for g in groups if g.ready), key=lambda g: g.finished)
    if not hold:
        return by_finish[:per_step] if len(by_finish) >= per_step else None
    deadline = lambda g: g.issued + max_staleness  # noqa: E731
    forced_count = must_train_now([deadline(g) for g in groups], step, per_step)
    if forced_count > per_step:  # the producer's admission rule keeps this from happening
        raise RuntimeError(f"{forced_count} groups are due at version {step}, more than a step trains ({per_step})")
    forced = sorted(groups, key=lambda g: (deadline(g), not g.ready, g.finished))[:forced_count]
    if not all(g.ready for g in forced):
        return None
    rest = [g for g in by_finish if g not in forced]
    if forced_count + len(rest) < per_step:
        return None
    return forced + rest[: per_step - forced_count]


class ThroughputStream:
    """`prompts(step, index)`: rollout batch `index`'s prompts (DAPO adds its first round's); a step trains as
    many groups as its own batch has prompts."""

    def __init__(
        self, max_staleness: int, partial_rollouts: bool, hold: bool, prompts: Callable[[StepContext, int], PromptBatch]
    ) -> None:
        self.max_staleness, self.partial_rollouts, self.hold, self.prompts = max_staleness, partial_rollouts, hold, prompts
        self.lock = threading.Condition()
        self.groups: list[Group] = []  # issued, not yet trained
        self.queue: deque[Group] = deque()  # prompts to issue (their `issued` is set when they are)
        self.next_batch = 0  # the next rollout batch whose prompts join the queue
        self.finished = 0
        self.version = 0  # the servers' version
        self.next_take = 0  # the version the next step takes its groups at (one more after a step took them)
        self.per_step = 1
        self.dropped = 0  # groups dropped since the last step
        self.dropped_lengths: list[int] = []  # their response lengths, as their requests finish
        self.error: BaseException | None = None
        self.closed = False
        self.pool: ThreadPoolExecutor | None = None
        self.producer: threading.Thread | None = None
        self.step: StepContext | None = None
        self._saved_episodes = False  # the finished groups hold a checkpoint's episodes, as saved

    # ---- the step's view -------------------------------------------------------------------------------
    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer) -> Rollout:
        """This step's groups, scored (the dataloader's `batch` only counts the step)."""
        with self.lock:
            self._restore_episodes(step)
            self.version, self.next_take, self.step = step.policy_version, step.policy_version, step
            first = self.producer is None
            if first and not self.groups and not self.queue:  # a fresh stream begins at this step's batch
                self.next_batch = step.rollout_batch
            self._refill(step)
            if first:
                self._start(step)
            self.lock.notify_all()
        with timer("rollout_wait"):
            taken, dropped, lengths = self._take()
        timer.times["rollout"] = max(g.seconds for g in taken)  # the groups ran side by side
        groups = [g.completions for g in taken]
        oldest = min(v for group in groups for c in group for v in c.versions or [self.version])
        made = (PromptBatch.concat([g.prompt for g in taken]), [g.prompt_ids for g in taken], step.sampling())
        if step.environment is not None:
            rollout = episodes_rollout(step.tokenizer, *made, [g.episodes for g in taken], oldest, step.environment)
        else:
            rollout = to_rollout(step.tokenizer, *made, groups, oldest)
        dropped_metrics = {"groups_dropped": float(dropped)}
        if lengths:
            dropped_metrics["dropped_response_length_mean"] = sum(lengths) / len(lengths)
        return score_rollout(step, rollout.with_metrics(dropped_metrics), timer)

    def _take(self) -> tuple[list[Group], int, list[int]]:
        """This step's groups, the groups dropped since the last step and the lengths of those that finished."""
        with self.lock:
            if not self.hold:
                for g in [g for g in self.groups if g.issued + self.max_staleness < self.version]:
                    self._drop(g)
                self.lock.notify_all()
            while (taken := choose(self.groups, self.version, self.max_staleness, self.per_step, self.hold)) is None:
                if self.error is not None:
                    raise self.error
                self.lock.wait()
            for g in taken:
                self.groups.remove(g)
            self.next_take = self.version + 1
            dropped, lengths, self.dropped, self.dropped_lengths = self.dropped, self.dropped_lengths, 0, []
            self.lock.notify_all()  # room for more
            return taken, dropped, lengths

    def _drop(self, g: Group) -> None:
        """A group past its deadline: never trained; its prompt goes first in the queue, to be issued again."""
        g.dropped = True
        self.groups.remove(g)
        self.dropped += 1
        if g.ready:
            self.dropped_lengths += [len(c.token_ids) for c in g.completions]
        self.queue.appendleft(g.to_issue(g.attempt + 1))

    def wait(self, timer: StageTimer) -> None:
        """Nothing to wait for: the servers' sync freezes (or drains) the requests in flight itself."""

    def synced(self, version: int) -> None:
        """The servers hold `version`: groups issued from now carry it, and there is room for s·B more."""
        with self.lock:
            self.version = version
            self.lock.notify_all()

    def describe(self) -> str:
        """The queue and the finished groups, for the watchdog's report."""
        return (
            f"throughput, {self.max_staleness} ahead, servers at version {self.version}: {len(self.queue)} groups "
            f"queued, {len(self.groups)} finished, next step takes version {self.next_take}, closed={self.closed}"
        )

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        if self.producer is not None:
            self.producer.join()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The finished groups, and the prompts not yet trained (those being generated are issued again)."""
        with self.lock:
            waiting = [g.to_issue(g.attempt) for g in self.groups if not g.ready]
            return {
                "mode": "throughput",
                "max_staleness": self.max_staleness,
                "next_batch": self.next_batch,
                "per_step": self.per_step,
                "finished": [asdict(g) for g in self.groups if g.ready],
                "queue": [asdict(g) for g in [*waiting, *self.queue]],
            }

    def load_state_dict(self, state: dict) -> None:
        """Continue a throughput stream's saved groups; anything else starts afresh (from its step's batch)."""
        if state.get("mode") != "throughput":
            return

        def group(d: dict) -> Group:
            d = {**d, "source": tuple(d["source"]), "prompt": PromptBatch(**d["prompt"])}
            if d["completions"] is not None:
                d["completions"] = [Completion.from_state(c) for c in d["completions"]]
            return Group(**d)

        self.groups = [group(d) for d in state["finished"]]  # their episodes stay dicts until `_restore_episodes`
        self.queue = deque(group(d) for d in state["queue"])
        self.next_batch, self.per_step = state["next_batch"], state["per_step"]
        self.finished = max((g.finished for g in self.groups), default=-1) + 1
        self._saved_episodes = any(g.episodes for g in self.groups)

    def _restore_episodes(self, step: StepContext) -> None:
        """A checkpoint's episodes, rebuilt by the step's environment (which rebuilds its calls)."""
        if self._saved_episodes:
            for g in self.groups:
                g.episodes = [Episode.from_state(e, step.environment) for e in g.episodes]
            self._saved_episodes = False

    # ---- the producer ---------------------------------------------------------------------------------
    def _start(self, step: StepContext) -> None:
        step.engine.stream_across_syncs(keep_partial=self.partial_rollouts)
        capacity = (self.max_staleness + 1) * self.per_step
        self.pool = ThreadPoolExecutor(min(capacity, MAX_REQUEST_THREADS), thread_name_prefix="rollout-group")
        self.producer = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self.producer.start()

    def _produce(self) -> None:
        """Issue the queued prompts' groups while `_can_issue`, until the stream closes."""
        while True:
            with self.lock:
                while not self.closed and not self._can_issue():
                    self.lock.wait()
                if self.closed:
                    return
                g = self.queue.popleft()
                g.issued = self.version
                self.groups.append(g)
                step = self.step
            self.pool.submit(self._generate, step, g)

    def _can_issue(self) -> bool:
        """Room for a group issued now (deadline version + s): the steps from the next take to that deadline
        train (version + s − next_take + 1)·B groups; (s + 1)·B before a step takes its groups, s·B after."""
        room = (self.version + self.max_staleness - self.next_take + 1) * self.per_step
        return bool(self.queue) and len(self.groups) < room

    def _refill(self, step: StepContext) -> None:
        """Queue the prompts of the batches up to s + 1 after this step's (in this thread: `prompts` may draw
        from the data module's streams, which the step's own draws must not race)."""
        last = min(step.total_rollout_batches, step.rollout_batch + self.max_staleness + 2)
        while self.next_batch < last:
            batch = self.prompts(step, self.next_batch)
            for i, ids in enumerate(encode_prompts(step.tokenizer, batch)):
                self.queue.append(Group((self.next_batch, i), batch.select([i]), ids, issued=-1))
            self.per_step = len(batch)
            self.next_batch += 1

    def _generate(self, step: StepContext, g: Group) -> None:
        started = time.perf_counter()
        index, position = g.source
        seed = derived_seed(step.seed, index, GROUP_STREAM + g.attempt, step.collectives.rank) * 1009 + position
        episodes: list[Episode] = []
        try:
            generate, sampling = partial(step.engine.generate, first_replica=position), step.sampling(seed=seed)
            if step.environment is None:
                (completions,) = generate([g.prompt_ids], sampling)
            else:  # its turns: each request carries the weights' versions, a sync may fall between two of them
                env = step.environment
                episodes = start_episodes([g.prompt_ids], sampling.group_size, g.prompt)
                advance_episodes(generate, step.tokenizer, episodes, sampling, env)
                completions = [e.completion(env.excluded(e)) for e in episodes]
        except BaseException as e:  # the step that waits for groups raises it
            with self.lock:
                self.error = e
                self.lock.notify_all()
            return
        with self.lock:
            g.completions, g.episodes = completions, episodes
            g.finished, g.seconds = self.finished, time.perf_counter() - started
            self.finished += 1
            if g.dropped:  # dropped while it was generated: only its lengths count
                self.dropped_lengths += [len(c.token_ids) for c in completions]
            self.lock.notify_all()
