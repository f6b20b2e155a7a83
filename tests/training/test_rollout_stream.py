"""Rollouts generated ahead with bounded staleness (`RolloutStream`) without servers: which batch is
generated when, by which policy version, token by token; where partial rollouts interrupt and continue a
sequence; the seeds; nothing past the run's last batch; and a saved stream continuing as the unsaved one."""

from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import pytest

from rlvr_lightning.algos import GRPO
from rlvr_lightning.callbacks.progress import rollout_batches_total
from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, SamplingConfig
from rlvr_lightning.training.generation import sampling_seed
from rlvr_lightning.training.rollout_stream import RolloutStream
from rlvr_lightning.training.scoring import Scoring
from rlvr_lightning.training.step_metrics import StageTimer

MAX_TOKENS = 12
EOS = 2


def batch_at(k: int) -> PromptBatch:
    return PromptBatch([f"p{k}"], [f"prompt {k}"], ["0"])


def draw(*key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest(), "little")


class VersionedEngine:
    """The engine protocol as a seeded sampler: each sample's tokens are a function of its request's seed and
    prompt, it stops with EOS after a drawn length or at `max_tokens`, and each token's log-prob names the
    weight version the engine holds (−(version + 1)/10), so a test reads which version sampled it."""

    concurrent_requests = True  # thread-safe, each sample a function of its request: segments run side by side

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[list[list[int]], SamplingConfig, int]] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling):
        with self.lock:
            self.calls.append((prompt_ids, sampling, self.version))
        groups = []
        for prompt in prompt_ids:
            group = []
            for j in range(sampling.group_size):
                length = 1 + draw(sampling.seed, tuple(prompt), j, "length") % 16
                tokens = [3 + draw(sampling.seed, tuple(prompt), j, t) % 50 for t in range(min(length, sampling.max_tokens))]
                stopped = length <= sampling.max_tokens
                if stopped:
                    tokens[-1] = EOS
                logprobs = [-(self.version + 1) / 10] * len(tokens)
                group.append(Completion(tokens, logprobs, "stop" if stopped else "length"))
            groups.append(group)
        return groups


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[len(text), int(text.split()[-1])])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x"] * len(ids)


def context(max_steps: int, num_mini_batches: int, engine, k: int = 0, group_size: int = 4) -> StepContext:
    """Step k's context (policy version k); the run's length from max_steps as the module computes it."""
    data = SimpleNamespace(batch_at=batch_at)
    trainer = SimpleNamespace(max_steps=max_steps, max_epochs=None)
    total = rollout_batches_total(trainer, GRPO(num_mini_batches=num_mini_batches))  # no weights until configure_model
    return StepContext(
        policy=None, ref_policy=None, engines=SimpleNamespace(engine=engine, environment=None), tokenizer=Tokenizer(), prompts=data,
        sampling=lambda seed: SamplingConfig(group_size=group_size, max_tokens=MAX_TOKENS, seed=seed),
        collectives=Collectives(), device=None, rollout_batch=k, policy_version=k, total_rollout_batches=total,
        seed=3, scoring=Scoring(RewardSettings(correctness="tests.support.rewards.all_correct")),
    )  # fmt: skip


def train(stream: RolloutStream, engine, steps: range, max_steps: int = 6, num_mini_batches: int = 1) -> list:
    """The training loop's view: collect batch k at version k, 'update', wait, then sync version k + 1."""
    rollouts = []
    for k in steps:
        rollouts.append(stream.collect(context(max_steps, num_mini_batches, engine, k), batch_at(k), StageTimer()))
        stream.wait(StageTimer())
        engine.version = k + 1
    return rollouts


def token_versions(rollout) -> list[int]:
    return [v for c in rollout.completions for v in c.versions_or(rollout.policy_version)]


def run(max_staleness: int, partial: bool, steps: int = 6) -> tuple[list, VersionedEngine]:
    engine, stream = VersionedEngine(), RolloutStream(max_staleness, partial)
    try:
        return train(stream, engine, range(steps), max_steps=steps), engine
    finally:
        stream.close()


def test_one_version_ahead_generates_each_batch_whole_by_the_previous_policy_with_its_own_seed():
    rollouts, engine = run(1, partial=False, steps=4)
    assert [r.batch.ids for r in rollouts] == [["p0"], ["p1"], ["p2"], ["p3"]]
    # Batch 0 is generated at step 0 by version 0; batch k ≥ 1 at step k−1, by version k−1, whole.
    assert [r.policy_version for r in rollouts] == [0, 0, 1, 2]
    assert [set(token_versions(r)) for r in rollouts] == [{0}, {0}, {1}, {2}]
    # Each batch's generation uses the seed of its own rollout batch, as the synchronous loop would.
    ctx = context(4, 1, engine)
    assert [s.seed for _, s, _ in engine.calls] == [sampling_seed(ctx, rollout_batch=k) for k in range(4)]
    assert all(s.max_tokens == MAX_TOKENS for _, s, _ in engine.calls)
    assert [r.correct.tolist() for r in rollouts] == [[1.0] * 4] * 4  # scored by the rollout callbacks


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("s", [1, 2, 3])
def test_no_trained_token_is_more_than_max_staleness_versions_old(s, partial):
    rollouts, _ = run(s, partial, steps=7)
    for k, r in enumerate(rollouts):
        ages = [k - v for v in token_versions(r)]
        assert 0 <= min(ages) and max(ages) <= s, (k, ages)
        assert r.staleness(k)["staleness_max"] == max(ages)
    # In the steady state whole batches are exactly s versions old; partial ones from 1 to s.
    steady = [k - v for k, r in list(enumerate(rollouts))[s:] for v in token_versions(r)]
    assert max(steady) == s and min(steady) == (1 if partial and s > 1 else s)


def test_partial_rollouts_continue_interrupted_sequences_under_the_next_version():
    rollouts, engine = run(2, partial=True, steps=5)
    r = rollouts[3]  # batch 3: segment 0 at step 1 (version 1), segment 1 at step 2 (version 2)
    cap = MAX_TOKENS // 2
    for c in r.completions:
        versions = c.versions
        assert len(versions) == len(c.token_ids) == len(c.logprobs)
        assert versions == [1] * min(len(c.token_ids), cap) + [2] * max(0, len(c.token_ids) - cap)
        # Each token's behaviour log-prob is the one its own version reported.
        assert c.logprobs == [-(v + 1) / 10 for v in versions]
    continued = [c for c in r.completions if len(c.token_ids) > cap]
    stopped_early = [c for c in r.completions if len(c.token_ids) < cap]
    assert continued and stopped_early  # the draw gives both kinds
    assert all(c.finish_reason == "stop" for c in stopped_early)  # not continued: they stopped on EOS
    # The continuation requests: one sample per interrupted sequence, its prompt + its first segment's tokens,
    # at most the remaining tokens, with a seed of its own.
    (prompts, sampling, version), = [c for c in engine.calls if c[1].group_size == 1 and c[2] == 2 and len(c[0]) == len(continued)]
    assert version == 2 and sampling.max_tokens == MAX_TOKENS - cap
    assert sorted(prompts) == sorted(r.prompt_ids[0] + c.token_ids[:cap] for c in continued)
    assert len({s.seed for _, s, _ in engine.calls}) == len(engine.calls)


@pytest.mark.parametrize("max_steps, num_mini_batches, batches", [(4, 1, 4), (8, 2, 4), (6, 3, 2)])
@pytest.mark.parametrize("s", [1, 3])
def test_nothing_is_generated_past_the_last_rollout_batch(max_steps, num_mini_batches, batches, s):
    """`trainer.max_steps` counts optimizer steps: K per rollout batch."""
    engine, stream = VersionedEngine(), RolloutStream(s, partial_rollouts=True)
    try:
        train(stream, engine, range(batches), max_steps, num_mini_batches)
        assert stream.in_flight == {}
        assert {tuple(p[0]) for p, sampling, _ in engine.calls if sampling.group_size > 1} == {
            tuple(Tokenizer()(batch_at(k).prompts[0]).input_ids) for k in range(batches)
        }
    finally:
        stream.close()


@pytest.mark.parametrize("partial", [False, True])
def test_a_stream_saved_between_steps_and_loaded_continues_as_the_unsaved_one(partial):
    import torch

    whole, _ = run(3, partial, steps=6)
    engine, first = VersionedEngine(), RolloutStream(3, partial)
    train(first, engine, range(2), max_steps=6)
    saved = torch.load(_roundtrip(first.state_dict()), weights_only=False)  # as a checkpoint holds it
    first.close()
    resumed = RolloutStream(3, partial)
    resumed.load_state_dict(saved)
    try:
        rest = train(resumed, engine, range(2, 6), max_steps=6)
    finally:
        resumed.close()
    for a, b in zip(whole[2:], rest, strict=True):
        assert (a.completions, a.policy_version) == (b.completions, b.policy_version)


def _roundtrip(state):
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_a_stream_of_other_settings_starts_afresh_from_a_checkpoint():
    engine, first = VersionedEngine(), RolloutStream(2, partial_rollouts=True)
    train(first, engine, range(2), max_steps=6)
    state = first.state_dict()
    first.close()
    other = RolloutStream(1, partial_rollouts=False)
    other.load_state_dict(state)
    assert other.in_flight == {}
    other.close()


# ---- the module's step with a batch generated ahead (HF engine, one step off policy) --------------------


def test_a_lagged_batch_trains_on_the_engines_logprobs_and_the_sync_waits_for_the_batch_ahead(lagged_module):
    import torch

    module = lagged_module()
    events = module.events
    batches = iter(module.trainer.datamodule.train_dataloader())
    first = module.train_on_batch(next(batches))
    module.rollout_batches += 1
    # Batch 0 (nothing was ahead yet, so generated then, in this thread), then batch 1, generated ahead
    # during step 0's update: the sync after step 0 waited for it to finish before loading new weights.
    assert events == ["ahead generated", "load_weights"]
    second = module.train_on_batch(next(batches))
    assert module.rlvr_step.resolved.behaviour == "rollout"
    assert (first.metrics["staleness_max"], second.metrics["staleness_max"]) == (0.0, 1.0)
    # Batch 1 was sampled by version 0 and trained at version 1: θ_old is what the engine reported.
    t = second.inputs.tensors
    torch.testing.assert_close(second.inputs.behaviour.old_logp_all(), t.rollout_logp * t.response_mask)
    assert second.rollout.policy_version == 0


def test_a_lagged_batch_with_a_rollout_correction_weighs_the_trainers_theta_old_against_the_engine(lagged_module):
    import torch

    module = lagged_module(rollout_correction={"name": "tis-token", "knobs": {"tis_cap": 1.5}})
    assert module.rlvr_step.resolved.behaviour == "trainer"
    result = module.train_on_batch(next(iter(module.trainer.datamodule.train_dataloader())))
    inputs = result.inputs
    mask = inputs.loss_mask
    trainer_old = inputs.behaviour.old_logp_all()
    expected = (trainer_old - inputs.tensors.rollout_logp).exp().clamp(max=1.5) * mask
    torch.testing.assert_close(inputs.is_weight, expected)


def test_two_versions_ahead_with_partial_rollouts_train_on_each_tokens_own_behaviour_logprob(lagged_module):
    """The module's steps at max_staleness 2 with partial rollouts (the HF engine standing where the servers
    would, on its own copy of the policy that changes only through the weight sync)."""
    import torch

    module = lagged_module(max_staleness=2, partial_rollouts=True)
    batches = iter(module.trainer.datamodule.train_dataloader())
    results = []
    for _ in range(4):
        results.append(module.train_on_batch(next(batches)))
        module.rollout_batches += 1
    stale = [r.metrics["staleness_max"] for r in results]
    assert stale == [0.0, 1.0, 2.0, 2.0]
    assert all(r.times["rollout"] > 0 and "rollout_wait" in r.times for r in results)  # each batch's own generation
    last = results[-1]
    assert module.rlvr_step.resolved.behaviour == "rollout"
    t = last.inputs.tensors
    # θ_old is each token's own behaviour log-prob, from the version that sampled it.
    torch.testing.assert_close(last.inputs.behaviour.old_logp_all(), t.rollout_logp * t.response_mask)
    versions = {v for c in last.rollout.completions for v in c.versions}
    assert versions <= {1, 2} and 1 in versions  # batch 3: its first half by version 1, the rest by version 2
    assert module.session.stream.state_dict()["in_flight"]  # batches 4 and 5 are in flight between steps


def _real():
    from rlvr_lightning.algos import REAL

    return {"module_class": REAL}


def _thr():
    return {"shapers": {"thr": {"p": 0.5}}}  # p = 0 would be the base algorithm, not scored


def _lora():
    return {"lora": {"rank": 4}}


@pytest.mark.parametrize("setup, ran", [(_real, "s_bar_pos"), (_thr, "thr/dominant_frac"), (_lora, "grad_norm")],
                         ids=["real", "thr", "lora"])  # fmt: skip
def test_real_thr_and_a_lora_policy_train_two_versions_ahead_with_partial_rollouts(lagged_module, setup, ran):
    """REAL's whole groups, THR scoring with the policy being updated, and a LoRA policy's weight sync, each
    through the module's steps at max_staleness 2 with partial rollouts."""
    import math

    from tests.support.rewards import PARITY

    kwargs = setup()
    # Correctness the untrained policy earns (mixed groups), so REAL's and THR's signals are not all zero.
    kwargs["rewards"] = RewardSettings(correctness=PARITY)
    module = lagged_module(max_staleness=2, partial_rollouts=True, **kwargs)
    batches = iter(module.trainer.datamodule.train_dataloader())
    results = []
    for _ in range(3):
        results.append(module.train_on_batch(next(batches)))
        module.rollout_batches += 1
    assert [r.metrics["staleness_max"] for r in results] == [0.0, 1.0, 2.0]
    assert all(math.isfinite(r.metrics["loss"]) for r in results)
    assert any(ran in r.metrics for r in results), [sorted(r.metrics) for r in results]  # the piece ran
    assert module.session.policy_version == 3 and module.events.count("load_weights") == 3


HALF_MIXED = RewardSettings(correctness="tests.support.rewards.half_mixed")  # half the groups of two mixed


def test_dapo_takes_its_first_round_from_the_stream_and_refills_it_with_the_current_policy(lagged_module):
    """DAPO's dynamic sampling two versions ahead: round 0 (the dataloader's batch and its extra prompts) was
    generated ahead; with one mixed group of the two it needs, a second round is generated now, by the
    version being trained, and the batch keeps each token's version."""
    from rlvr_lightning.algos import DAPO

    module = lagged_module(max_staleness=2, partial_rollouts=True, module_class=DAPO, gen_batch_size=2,
                           rewards=HALF_MIXED)  # fmt: skip
    batches = iter(module.trainer.datamodule.train_dataloader())
    results = []
    for _ in range(3):
        results.append(module.train_on_batch(next(batches)))
        module.rollout_batches += 1
    last = results[-1]
    assert [r.rollout.metrics["dynamic_sampling_rounds"] for r in results] == [2.0, 2.0, 2.0]
    assert len(last.rollout.batch) == 2  # the batch's two prompts: one mixed group from each round
    versions = [set(c.versions) for c in last.rollout.completions]
    assert versions[2:] == [{2}, {2}]  # the refill, generated now by version 2
    assert versions[0] <= {0, 1} and last.metrics["staleness_max"] == 2.0  # round 0: ahead, by versions 0 and 1


def test_every_step_of_a_stream_logs_its_wait_the_last_one_too():
    """The last rollout batch starts nothing in the background, yet its step logs `time/rollout_wait` (0)."""
    engine, stream = VersionedEngine(), RolloutStream(2, partial_rollouts=True)
    timers = []
    try:
        for k in range(3):
            timers.append(StageTimer())
            stream.collect(context(3, 1, engine, k), batch_at(k), timers[-1])
            stream.wait(StageTimer())
            engine.version = k + 1
    finally:
        stream.close()
    assert all("rollout_wait" in t.times and "rollout" in t.times for t in timers), [t.times for t in timers]
