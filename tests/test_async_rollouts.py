"""One-step-off-policy rollouts (`RolloutsAhead`) without servers: which batch is generated ahead, by
which policy version, with which seed, and that nothing is generated past the run's last rollout batch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from rlvr_lightning.callbacks.progress import rollout_batches_total
from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.rollout.types import Completion, PromptBatch, SamplingConfig
from rlvr_lightning.training.async_rollouts import RolloutsAhead
from rlvr_lightning.training.generation import sampling_seed
from rlvr_lightning.training.step_metrics import StageTimer


def batch_at(k: int) -> PromptBatch:
    return PromptBatch([f"p{k}"], [f"prompt {k}"], ["0"])


class RecordingEngine:
    """Answers every prompt with one token, and records what it was asked to generate."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingConfig]] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling):
        with self.lock:
            self.calls.append((prompt_ids, sampling))
        return [[Completion(token_ids=[1], logprobs=[-0.5], finish_reason="stop")] * sampling.n for _ in prompt_ids]


class AllCorrect(RolloutCallback):
    def on_rollout_generated(self, step, rollout):
        rollout.correct = [True] * len(rollout.completions)
        rollout.rewards = [1.0] * len(rollout.completions)


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[len(text), int(text.split()[-1])])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x"] * len(ids)


def context(max_steps: int, mini_batches: int, engine: RecordingEngine, k: int = 0) -> StepContext:
    """Step k's context; the run's length from max_steps as the module computes it."""
    data = SimpleNamespace(train_batch_at=batch_at, sampling=lambda seed: SamplingConfig(n=2, max_tokens=4, seed=seed))
    trainer = SimpleNamespace(max_steps=max_steps, max_epochs=None)
    total = rollout_batches_total(trainer, SimpleNamespace(hparams=SimpleNamespace(mini_batches=mini_batches, ppo_epochs=1)))
    return StepContext(
        policy=None, ref_policy=None, engine=engine, tokenizer=Tokenizer(), data=data, collectives=Collectives(),
        device=None, rollout_batch=k, policy_version=k, total_rollout_batches=total, seed=3, scorers=(AllCorrect(),),
    )  # fmt: skip


def train(ahead: RolloutsAhead, max_steps: int, mini_batches: int, engine: RecordingEngine, batches: int) -> list:
    """The training loop's view: collect batch k at policy version k, 'update', then sync version k+1."""
    rollouts = []
    for k in range(batches):
        rollouts.append(ahead.collect(context(max_steps, mini_batches, engine, k), batch_at(k), StageTimer()))
        ahead.wait(StageTimer())
    return rollouts


def test_each_batch_is_generated_one_step_ahead_by_the_previous_policy():
    engine = RecordingEngine()
    ahead = RolloutsAhead()
    try:
        rollouts = train(ahead, 4, 1, engine, 4)
    finally:
        ahead.close()
    assert [r.batch.ids for r in rollouts] == [["p0"], ["p1"], ["p2"], ["p3"]]
    # Batch 0 is generated at step 0 by version 0; batch k ≥ 1 at step k−1, by version k−1.
    assert [r.policy_version for r in rollouts] == [0, 0, 1, 2]
    # Each batch's generation uses the seed of its own rollout batch, as the synchronous loop would.
    seeds = [sampling_seed(context(4, 1, engine), rollout_batch=k) for k in range(4)]
    assert [s.seed for _, s in engine.calls] == seeds
    assert [r.correct for r in rollouts] == [[True, True]] * 4  # scored by the rollout callbacks


@pytest.mark.parametrize("max_steps, mini_batches, batches", [(4, 1, 4), (8, 2, 4), (6, 3, 2)])
def test_nothing_is_generated_past_the_last_rollout_batch(max_steps, mini_batches, batches):
    """`trainer.max_steps` counts optimizer steps: K per rollout batch."""
    engine = RecordingEngine()
    ahead = RolloutsAhead()
    try:
        train(ahead, max_steps, mini_batches, engine, batches)
        assert ahead.in_flight is None
        assert len(engine.calls) == batches
    finally:
        ahead.close()
