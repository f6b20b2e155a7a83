"""The throughput mode of the rollout stream (`rollout.stream.mode: throughput`): which groups a step trains
(`must_train_now`, `choose`) on hand-checked cases and on random finishing orders, the drop and hold
settings and the dropped-length metric on a stand-in server whose groups finish when the test says, and a
real run on a `vllm serve` replica."""

from __future__ import annotations

import random
import string
import threading
from types import SimpleNamespace

import pytest

from rlvr_lightning.environments.base import Environment, Reply
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.settings import RolloutSettings, StreamSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch
from rlvr_lightning.training.throughput_stream import Group, choose, must_train_now


def group(issued: int, finished: int = -1, length: int = 3) -> Group:
    done = None if finished < 0 else [Completion([1] * length, [0.0] * length, "stop")]
    return Group((0, 0), PromptBatch(["p"], ["p"], ["1"]), [1], issued, completions=done, finished=finished)


# ---- which groups a step trains --------------------------------------------------------------------------
@pytest.mark.parametrize("deadlines, expected", [
    ([], 0),
    ([5, 6, 6, 7], 1),  # the one due now
    ([6, 6, 6, 7], 1),  # step 6 trains 2 of the three due then: one must go now
    ([7] * 6, 2),  # steps 5, 6, 7 train 2 each: all six, so 2 now
    ([7, 7, 8, 8], 0),  # room for all later
    ([5, 5], 2),
])  # fmt: skip
def test_must_train_now_by_hand(deadlines, expected):
    assert must_train_now(deadlines, step=5, per_step=2) == expected


def test_hold_takes_the_due_groups_first_and_waits_for_them():
    due_unfinished, due_finished = group(issued=3), group(issued=3, finished=5)
    newer = [group(issued=4, finished=0), group(issued=5, finished=1)]
    # Step 5, s = 2: both issued at 3 are due; one is still generating: the step waits.
    assert choose([due_unfinished, due_finished, *newer], step=5, max_staleness=2, per_step=2, hold=True) is None
    due_unfinished.completions, due_unfinished.finished = due_finished.completions, 6
    taken = choose([due_unfinished, due_finished, *newer], step=5, max_staleness=2, per_step=2, hold=True)
    assert set(map(id, taken)) == {id(due_unfinished), id(due_finished)}  # not the ones that finished first
    # None due: the earliest finished, whatever their versions.
    taken = choose([group(5, finished=3), group(4, finished=2), group(5, finished=1)], 5, 2, 2, hold=True)
    assert [g.finished for g in taken] == [1, 2]


def test_drop_mode_takes_the_earliest_finished():
    groups = [group(3), group(5, finished=2), group(4, finished=0), group(5, finished=1)]
    assert [g.finished for g in choose(groups, 5, 2, 2, hold=False)] == [0, 1]
    assert choose(groups[:2], 5, 2, 2, hold=False) is None  # one finished: wait


@pytest.mark.parametrize("max_staleness, per_step", [(1, 1), (1, 3), (2, 2), (3, 4)])
def test_hold_trains_every_group_within_its_staleness_whatever_the_finishing_order(max_staleness, per_step):
    """Issue up to (s + 1)·B groups a step, let random ones finish, take what `choose` takes (finishing more
    while it waits): no group trains more than s versions after it was issued, and none is lost."""
    rng = random.Random(max_staleness * 100 + per_step)
    outstanding: list[Group] = []
    finished = issued = trained = 0
    for step in range(60):
        # The stream's admission rule (`_can_issue`): (s + 1)·B outstanding before the step takes its groups.
        while len(outstanding) < (max_staleness + 1) * per_step:
            outstanding.append(group(issued=step))
            issued += 1
        for g in outstanding:  # some finish during the update
            if not g.ready and rng.random() < 0.4:
                g.completions, g.finished, finished = [], finished, finished + 1
        while (taken := choose(outstanding, step, max_staleness, per_step, hold=True)) is None:
            g = rng.choice([g for g in outstanding if not g.ready])  # the step waits: one more finishes
            g.completions, g.finished, finished = [], finished, finished + 1
        assert len(taken) == per_step
        assert all(step - g.issued <= max_staleness for g in taken), [step - g.issued for g in taken]
        for g in taken:
            outstanding.remove(g)
        trained += len(taken)
        while len(outstanding) < max_staleness * per_step:  # s·B after it, until the sync: still version `step`
            outstanding.append(group(issued=step))
            issued += 1
    assert trained + len(outstanding) == issued


# ---- settings ---------------------------------------------------------------------------------------------
def test_the_throughput_settings_are_checked():
    with pytest.raises(ConfigError, match="max_staleness ≥ 1"):
        RolloutSettings(engine="vllm-server", stream={"mode": "throughput"})
    with pytest.raises(ConfigError, match="stale_groups=drop needs rollout.stream.mode=throughput"):
        RolloutSettings(engine="vllm-server", stream={"max_staleness": 2, "stale_groups": "drop"})
    with pytest.raises(ConfigError, match="rollout.stream.mode"):
        RolloutSettings(engine="vllm-server", stream={"max_staleness": 2, "mode": "fast"})
    RolloutSettings(engine="vllm-server", stream=StreamSettings(max_staleness=2, mode="throughput", stale_groups="drop"))


# ---- the stream on a stand-in server whose groups finish when the test says --------------------------------
class GatedServer:
    """The HF engine on its own copy of the policy, standing where a `vllm serve` replica would: a sync waits
    for the requests in flight (vLLM's `/pause?mode=wait`), every token carries the version that sampled it,
    and the first group's request finishes only when the test opens the gate."""

    def __init__(self, policy, tokenizer) -> None:
        import copy
        from functools import partial

        from rlvr_lightning.models.forward import sequence_logprobs
        from rlvr_lightning.rollout.hf_engine import HFGenerateEngine

        self.model = copy.deepcopy(policy)
        self.engine = HFGenerateEngine(self.model, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                       partial(sequence_logprobs, self.model))  # fmt: skip
        self.gate, self.lock, self.version, self.requests = threading.Event(), threading.Lock(), 0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_across_syncs(self, keep_partial: bool) -> None:
        pass

    def generate(self, prompt_ids, sampling, first_replica=0):
        with self.lock:
            self.requests += 1
            first = self.requests == 1
        if first:
            assert self.gate.wait(60), "the test never opened the gate"
        with self.lock:
            groups = self.engine.generate(prompt_ids, sampling)
            return [[Completion(c.token_ids, c.logprobs, c.finish_reason, [self.version] * len(c.token_ids))
                     for c in g] for g in groups]  # fmt: skip

    def load_weights(self, weights, version=None):
        with self.lock:
            self.model.load_state_dict(dict(weights), strict=False)
            self.version = version

    def logprobs(self, prompt_ids, completion_ids, *args, **kwargs):  # the sync probe: not beside a generation
        with self.lock:
            return self.engine.logprobs(prompt_ids, completion_ids, *args, **kwargs)


def run_steps(module, steps: int) -> list:
    """`steps` more steps of the module; each step's result."""
    if not hasattr(module, "batches"):
        module.batches = iter(module.trainer.datamodule.train_dataloader())
    results = []
    for _ in range(steps):
        results.append(module.train_on_batch(next(module.batches)))
        module.rollout_batches += 1
    return results


def test_drop_reissues_late_groups_and_logs_their_lengths(lagged_module):
    """s = 1, two groups a step: the first group never finishes while the gate is shut, so the steps train
    the others as they finish; at step 2 it is past its deadline: dropped and its prompt issued again."""
    module = lagged_module(max_staleness=1, stream_mode="throughput", stale_groups="drop")
    server = module.session.engine = GatedServer(module.policy, module.trainer.datamodule.tokenizer)
    results = run_steps(module, 3)
    dropped = [r.rollout.metrics["groups_dropped"] for r in results]
    assert dropped[:2] == [0.0, 0.0] and dropped[2] >= 1
    assert all(r.metrics["staleness_max"] <= 1 for r in results)
    first = module.trainer.datamodule.prompts.batch_at(0).ids[0]
    assert first not in results[0].rollout.batch.ids + results[1].rollout.batch.ids
    stream = module.session.stream
    with stream.lock:  # issued again (attempt 1): trained at step 2 already, or still outstanding
        again = [g for g in [*stream.groups, *stream.queue] if g.source == (0, 0)]
        assert first in results[2].rollout.batch.ids or [g.attempt for g in again] == [1]
    server.gate.set()  # the dropped request finishes: its lengths reach the next step's metrics
    with stream.lock:
        assert stream.lock.wait_for(lambda: stream.dropped_lengths, timeout=60)
    (more,) = run_steps(module, 1)
    assert more.rollout.metrics["dropped_response_length_mean"] > 0


def test_hold_waits_for_the_due_group_and_drops_nothing(lagged_module):
    """The same gated first group under `hold`: still generating at step 0, due at step 1, so step 1 trains it
    (waiting for it if the gate has not opened yet); nothing is dropped and every prompt trains once."""
    module = lagged_module(max_staleness=1, stream_mode="throughput", stale_groups="hold")
    server = module.session.engine = GatedServer(module.policy, module.trainer.datamodule.tokenizer)
    results = run_steps(module, 1)
    threading.Timer(0.5, server.gate.set).start()  # before or during step 1's wait: either way step 1 trains it
    results += run_steps(module, 3)
    first = module.trainer.datamodule.prompts.batch_at(0).ids[0]
    assert first not in results[0].rollout.batch.ids and first in results[1].rollout.batch.ids  # by its deadline
    assert all(r.rollout.metrics["groups_dropped"] == 0 for r in results)
    assert all(r.metrics["staleness_max"] <= 1 for r in results)
    trained = [p for r in results for p in r.rollout.batch.ids]
    assert len(trained) == len(set(trained)) == 8  # every prompt trained once, none lost


def test_a_checkpoint_keeps_the_finished_groups_and_issues_the_others_again():
    import io

    import torch

    from rlvr_lightning.training.throughput_stream import ThroughputStream

    stream = ThroughputStream(2, True, hold=True, prompts=None)
    done, generating, queued = group(3, finished=4, length=5), group(4), group(-1)
    stream.groups, stream.queue, stream.next_batch, stream.per_step = [done, generating], [queued], 7, 2
    buffer = io.BytesIO()
    torch.save(stream.state_dict(), buffer)  # as the checkpoint holds it
    buffer.seek(0)
    resumed = ThroughputStream(2, True, hold=True, prompts=None)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    (kept,) = resumed.groups
    assert (kept.issued, kept.finished, kept.completions) == (3, 4, done.completions)
    assert [(g.source, g.completions) for g in resumed.queue] == [(generating.source, None), (queued.source, None)]
    assert (resumed.next_batch, resumed.per_step, resumed.finished) == (7, 2, 5)
    fresh = ThroughputStream(2, True, hold=True, prompts=None)
    fresh.load_state_dict({"max_staleness": 2, "partial_rollouts": True, "in_flight": []})  # the reproducible mode's
    assert (fresh.groups, list(fresh.queue)) == ([], [])


def test_dapo_takes_its_first_round_from_the_throughput_stream(lagged_module):
    """DAPO's round 0 is as many groups as its first round has prompts (the batch and its extra prompts),
    taken as they finish; its refills are generated now, by the version being trained."""
    from rlvr_lightning.algos import DAPO
    from tests.training.test_rollout_stream import HALF_MIXED

    module = lagged_module(max_staleness=2, stream_mode="throughput", module_class=DAPO, gen_batch_size=3,
                           rewards=HALF_MIXED)  # fmt: skip
    server = module.session.engine = GatedServer(module.policy, module.trainer.datamodule.tokenizer)
    server.gate.set()
    results = run_steps(module, 3)
    assert module.session.stream.per_step == 3  # a round of gen_batch_size 3: the batch's 2 prompts and 1 extra
    assert all(len(r.rollout.batch) == 2 for r in results)
    assert all(r.metrics["staleness_max"] <= 2 for r in results)


def test_a_weight_sync_lets_the_producer_issue_at_once():
    """After a step takes its groups the stream holds s·B until the sync; the sync itself must wake the
    producer to issue the next B (not the next group to finish, when none is generating)."""

    from rlvr_lightning.rollout.types import SamplingConfig
    from rlvr_lightning.training.throughput_stream import ThroughputStream

    def generate(prompt_ids, sampling, first_replica=0):
        return [[Completion([1], [0.0], "stop", [0]) for _ in range(sampling.group_size)]]

    engine = SimpleNamespace(stream_across_syncs=lambda keep_partial: None, generate=generate)
    step = SimpleNamespace(engine=engine, environment=None, total_rollout_batches=100, rollout_batch=0, seed=0, policy_version=0,
                           collectives=SimpleNamespace(rank=0), sampling=lambda **kw: SamplingConfig(group_size=2, **kw),
                           tokenizer=lambda text, add_special_tokens=False: SimpleNamespace(input_ids=[1]))  # fmt: skip
    batch = lambda step, i: PromptBatch([f"{i}.{j}" for j in range(2)], ["p", "p"], ["1", "1"])  # noqa: E731
    stream = ThroughputStream(1, False, hold=True, prompts=batch)
    with stream.lock:
        stream.step = step
        stream._refill(step)
        stream._start(step)
        stream.lock.notify_all()
    try:
        with stream.lock:  # (s + 1)·B = 4 issued and finished
            assert stream.lock.wait_for(lambda: len(stream.groups) == 4 and all(g.ready for g in stream.groups), 10)
        taken, _, _ = stream._take()
        assert len(taken) == 2
        with stream.lock:
            assert not stream.lock.wait_for(lambda: len(stream.groups) > 2, 0.5)  # s·B until the sync
        stream.synced(1)
        with stream.lock:
            assert stream.lock.wait_for(lambda: len(stream.groups) == 4, 5)
    finally:
        stream.close()


class Interject(Environment):
    """Ends a segment at any printable character the tiny policy samples and replies "!", up to three turns."""

    stop = tuple(string.printable)
    max_turns = 3

    def reply(self, episodes):
        return [Reply("!") for _ in episodes]


def test_in_an_environment_the_throughput_stream_trains_episodes_with_each_tokens_version(lagged_module):
    """A group's turns are requests of their own, so a sync may fall between two: every token keeps the version
    its request ran under, an inserted reply that of the token before it; the finished groups' episodes go into
    the checkpoint as plain values and come back whole."""
    import io

    import torch

    from rlvr_lightning.training.throughput_stream import ThroughputStream

    module = lagged_module(max_staleness=1, stream_mode="throughput")
    server = module.session.engine = GatedServer(module.policy, module.trainer.datamodule.tokenizer)
    module.session._environment = env = Interject()
    server.gate.set()
    results = run_steps(module, 3)
    inserted = 0
    assert any(r.rollout.metrics["turns_mean"] > 1 for r in results)
    for r in results:
        assert r.metrics["staleness_max"] <= 1
        for c in r.rollout.completions:
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs) and c.versions == sorted(c.versions)
            for i, s in enumerate(c.sampled_mask):
                if not s:
                    inserted += 1
                    assert i > 0 and c.versions[i] == c.versions[i - 1] and c.logprobs[i] == 0.0
    assert inserted > 0
    stream = module.session.stream
    with stream.lock:  # the groups of the next step, generated ahead
        assert stream.lock.wait_for(lambda: stream.groups and all(g.ready for g in stream.groups), 60)
        finished = list(stream.groups)
        buffer = io.BytesIO()
        torch.save(stream.state_dict(), buffer)
    assert finished and all(g.episodes for g in finished)
    buffer.seek(0)
    resumed = ThroughputStream(1, False, hold=True, prompts=None)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))  # as LightningCLI loads a checkpoint
    resumed._restore_episodes(SimpleNamespace(environment=env))
    saved = {g.source: g.episodes for g in finished}
    assert {g.source: g.episodes for g in resumed.groups} == saved
