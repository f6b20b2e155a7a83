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
from rlvr_lightning.training.generation import sampling_seed
from rlvr_lightning.training.rollouts_ahead import RolloutsAhead
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
        return [[Completion(token_ids=[1], logprobs=[-0.5], finish_reason="stop")] * sampling.group_size for _ in prompt_ids]


class AllCorrect(RolloutCallback):
    def on_rollout_generated(self, step, rollout):
        rollout.correct = [True] * len(rollout.completions)
        rollout.rewards = [1.0] * len(rollout.completions)


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[len(text), int(text.split()[-1])])

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x"] * len(ids)


def context(max_steps: int, num_mini_batches: int, engine: RecordingEngine, k: int = 0) -> StepContext:
    """Step k's context; the run's length from max_steps as the module computes it."""
    data = SimpleNamespace(train_batch_at=batch_at)
    trainer = SimpleNamespace(max_steps=max_steps, max_epochs=None)
    total = rollout_batches_total(
        trainer, SimpleNamespace(hparams=SimpleNamespace(num_mini_batches=num_mini_batches, ppo_epochs=1))
    )
    return StepContext(
        policy=None, ref_policy=None, rollout_engine=lambda: engine, tokenizer=Tokenizer(), data=data,
        sampling=lambda seed: SamplingConfig(group_size=2, max_tokens=4, seed=seed), collectives=Collectives(),
        device=None, rollout_batch=k, policy_version=k, total_rollout_batches=total, seed=3, scorers=(AllCorrect(),),
    )  # fmt: skip


def train(ahead: RolloutsAhead, max_steps: int, num_mini_batches: int, engine: RecordingEngine, batches: int) -> list:
    """The training loop's view: collect batch k at policy version k, 'update', then sync version k+1."""
    rollouts = []
    for k in range(batches):
        rollouts.append(ahead.collect(context(max_steps, num_mini_batches, engine, k), batch_at(k), StageTimer()))
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


@pytest.mark.parametrize("max_steps, num_mini_batches, batches", [(4, 1, 4), (8, 2, 4), (6, 3, 2)])
def test_nothing_is_generated_past_the_last_rollout_batch(max_steps, num_mini_batches, batches):
    """`trainer.max_steps` counts optimizer steps: K per rollout batch."""
    engine = RecordingEngine()
    ahead = RolloutsAhead()
    try:
        train(ahead, max_steps, num_mini_batches, engine, batches)
        assert ahead.in_flight is None
        assert len(engine.calls) == batches
    finally:
        ahead.close()


# ---- the module's step with a batch generated ahead (HF engine, one step off policy) --------------------


class SlowAheadServer:
    """Stands where a rollout server would: the HF engine on its own copy of the policy, which gets the
    trainer's weights only through `load_weights`. A generation running in the look-ahead thread takes
    0.5 s more and records when it ends, so a weight sync that did not wait for it would be seen
    loading weights first."""

    def __init__(self, policy, tokenizer, events: list[str]) -> None:
        import copy
        from functools import partial

        from rlvr_lightning.models.forward import sequence_logprobs
        from rlvr_lightning.rollout.hf_engine import HFGenerateEngine

        self.model, self.events = copy.deepcopy(policy), events
        score = partial(sequence_logprobs, self.model)
        self.engine = HFGenerateEngine(self.model, tokenizer.pad_token_id, tokenizer.eos_token_id, score)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, sampling):
        groups = self.engine.generate(prompt_ids, sampling)
        if threading.current_thread().name.startswith("rollout-ahead"):
            import time

            time.sleep(0.5)
            self.events.append("ahead generated")
        return groups

    def load_weights(self, weights, version=None):
        self.events.append("load_weights")
        self.model.load_state_dict(dict(weights), strict=False)


@pytest.fixture
def lagged_module(tiny_policy_dir, monkeypatch):
    """GRPO with rollouts one step ahead (`rollout.batches_ahead`, which the data module allows only with
    servers) from a `SlowAheadServer`: the step's code path is the same whatever engine generates."""
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.callbacks.reward import RewardVerifier
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.standalone import standalone

    monkeypatch.setattr(GRPO, "generates_ahead", property(lambda self: True))

    def build(**model_kwargs):
        rollout = RolloutSettings(engine="hf", group_size=2, max_response_length=4)
        dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None, rollout=rollout)
        return standalone(GRPO(**model_kwargs), dm, callbacks=[RewardVerifier(num_workers=1)])

    built = []

    def with_server(**kw):
        module = build(**kw)
        module.events = []
        module._engine = SlowAheadServer(module.policy, module.datamodule.tokenizer, module.events)
        built.append(module)
        return module

    yield with_server
    for module in built:
        module.teardown("fit")
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")


def test_a_lagged_batch_trains_on_the_engines_logprobs_and_the_sync_waits_for_the_batch_ahead(lagged_module):
    import torch

    module = lagged_module()
    events = module.events
    batches = iter(module.datamodule.train_dataloader())
    first = module.train_on_batch(next(batches))
    module.rollout_batches += 1
    # Batch 0 (nothing was ahead yet, so generated then and waited for), then batch 1, generated ahead
    # during step 0's update: the sync after step 0 waited for it to finish before loading new weights.
    assert events == ["ahead generated", "ahead generated", "load_weights"]
    second = module.train_on_batch(next(batches))
    assert module.behaviour_source() == "rollout"
    assert (first.metrics["batches_ahead"], second.metrics["batches_ahead"]) == (0.0, 1.0)
    # Batch 1 was sampled by version 0 and trained at version 1: θ_old is what the engine reported.
    t = second.inputs.tensors
    torch.testing.assert_close(second.inputs.behaviour.old_logp_all(), t.rollout_logp * t.response_mask)
    assert second.rollout.policy_version == 0


def test_a_lagged_batch_with_a_rollout_correction_weighs_the_trainers_theta_old_against_the_engine(lagged_module):
    import torch

    module = lagged_module(rollout_correction="tis-token", tis_cap=1.5)
    assert module.behaviour_source() == "trainer"
    result = module.train_on_batch(next(iter(module.datamodule.train_dataloader())))
    inputs = result.inputs
    mask = inputs.loss_mask
    trainer_old = inputs.behaviour.old_logp_all()
    expected = (trainer_old - inputs.tensors.rollout_logp).exp().clamp(max=1.5) * mask
    torch.testing.assert_close(inputs.is_weight, expected)
