"""vLLM sleep mode (`rollout.sleep_level`): the option, the CPU fallback, and the order of sleep/wake-up calls.

Real sleep mode is UNVERIFIED: vLLM 0.32 supports it on CUDA/ROCm/XPU only (`ModelConfig` refuses
`enable_sleep_mode` elsewhere, and the CPU worker's `sleep`/`wake_up` only log a warning), and this
project has no GPU with vLLM. What these tests check instead:
- the option is validated and reaches the engine, which on CPU warns and runs without sleep mode;
- the order of calls `VLLMEngine` issues, against `RecordingLLM`, a stand-in for the `vllm.LLM` methods it
  calls (`sleep`, `wake_up`, `collective_rpc`, `reset_prefix_cache`, `generate`) that records them. It
  checks our order, not what vLLM does with it;
- that order driven through the real CPU engine: vLLM's own bookkeeping (the scheduler pauses on `sleep` and
  resumes only when every tag is awake again) is real there, only the memory part is skipped.
"""

from __future__ import annotations

import faulthandler
import logging
from argparse import ArgumentError
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.rollout.settings import EngineSite, RolloutSettings
from rlvr_lightning.rollout.types import SamplingConfig
from rlvr_lightning.rollout.vllm_engine import SleepCycle, VLLMEngine, sleep_level_for

ENGINE_LOG = "rlvr_lightning.rollout.vllm_engine"


# ---- the option ----------------------------------------------------------------------------------------


def test_bad_sleep_level_is_a_config_error_at_construction():
    with pytest.raises(ConfigError, match=r"rollout\.sleep_level=3; valid: 0, 1, 2"):
        RolloutSettings(sleep_level=3)
    assert RolloutDataModule(rollout=RolloutSettings(sleep_level=2)).rollout.sleep_level == 2


def test_bad_sleep_level_is_refused_at_parse_time():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(RolloutSettings, "rollout")
    assert parser.parse_args(["--rollout.sleep_level", "2"]).rollout.sleep_level == 2  # an int, as vLLM wants
    with pytest.raises(ArgumentError, match="rollout.sleep_level"):
        parser.parse_args(["--rollout.sleep_level", "3"])


def test_sleep_mode_is_off_with_a_warning_on_cpu(caplog):
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOG):
        assert sleep_level_for(2, on_cuda=False) == 0
    assert len(caplog.records) == 1 and "rollout.sleep_level=2 is ignored" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOG):
        assert sleep_level_for(2, on_cuda=True) == 2
        assert sleep_level_for(1, on_cuda=True) == 1
        assert sleep_level_for(0, on_cuda=False) == 0
    assert not caplog.records


# ---- the order of calls, against a recording stand-in for vllm.LLM ----------------------------------------


class RecordingLLM:
    """Records the `vllm.LLM` calls `VLLMEngine` makes. `wake_up` answers like vLLM 0.32's
    (`LLM.wake_up` → EngineCore.wake_up): True once no tag is asleep any more."""

    def __init__(self, wake_answers_true: bool = True) -> None:
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()
        self.wake_answers_true = wake_answers_true

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tuple(tags)))
        self.asleep -= set(tags)
        return self.wake_answers_true and not self.asleep

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> None:
        list(kwargs["weights_iterator"])  # consumed, as vLLM's reload does
        self.calls.append(("collective_rpc", method))

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, params, use_tqdm=False, lora_request=None) -> list[SimpleNamespace]:
        """No completions; a log-prob of -1 for every prompt token after the first (what `score` reads)."""
        self.calls.append(("generate",))
        logprobs = [[None] + [{t: SimpleNamespace(logprob=-1.0)} for t in p["prompt_token_ids"][1:]] for p in prompts]
        return [SimpleNamespace(outputs=[], prompt_logprobs=lp) for lp in logprobs]

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def engine_around(level: int, **llm_kwargs) -> tuple[RecordingLLM, VLLMEngine]:
    """`VLLMEngine`'s own methods over the stand-in (its constructor would build a real vLLM)."""
    llm = RecordingLLM(**llm_kwargs)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.sleep_cycle = llm, SleepCycle(llm, level)
    engine.adapters, engine.lora_request = None, None  # a full-weights engine, as without `lora_max_rank`
    return llm, engine


def synced_after_release(**llm_kwargs) -> tuple[RecordingLLM, VLLMEngine]:
    """A level-2 engine that released its memory and then took a weight sync, calls so far forgotten."""
    llm, engine = engine_around(2, **llm_kwargs)
    engine.release_memory()
    engine.load_weights(iter(WEIGHTS))
    llm.take()
    return llm, engine


WEIGHTS = [("w", torch.zeros(2))]
SAMPLING = SamplingConfig(group_size=1, max_tokens=2)
RELOAD = [("collective_rpc", "reload_weights"), ("reset_prefix_cache",)]


def test_level2_step_order_release_reload_then_generate():
    llm, engine = engine_around(2)
    engine.release_memory()
    assert llm.take() == [("sleep", 2)]
    engine.load_weights(iter(WEIGHTS))
    # The weights wake before the reload writes into them; the KV cache stays released through the sync.
    assert llm.take() == [("wake_up", ("weights",)), *RELOAD]
    engine.generate([[1, 2]], SAMPLING)
    assert llm.take() == [("wake_up", ("kv_cache",)), ("generate",)]
    engine.generate([[1, 2]], SAMPLING)
    assert llm.take() == [("generate",)]  # awake: no more wake-ups


def test_sync_probe_score_after_the_reload_wakes_the_kv_cache():
    llm, engine = synced_after_release()
    assert engine.logprobs([1], [2]) == [-1.0]
    assert llm.take() == [("wake_up", ("kv_cache",)), ("generate",)]


def test_release_twice_sleeps_once():
    llm, engine = engine_around(2)
    engine.release_memory()
    engine.release_memory()
    assert llm.take() == [("sleep", 2)]


def test_level0_never_sleeps_or_wakes():
    llm, engine = engine_around(0)
    engine.release_memory()
    engine.load_weights(iter(WEIGHTS))
    engine.generate([[1, 2]], SAMPLING)
    engine.release_memory()
    assert llm.take() == [*RELOAD, ("generate",)]


def test_level1_generate_without_reload_wakes_weights_then_kv_cache():
    llm, engine = engine_around(1)
    engine.release_memory()
    engine.generate([[1, 2]], SAMPLING)
    assert llm.take() == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("generate",)]


def test_level2_generate_before_reload_is_an_error_not_garbage():
    llm, engine = engine_around(2)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="discards its weights"):
        engine.generate([[1, 2]], SAMPLING)
    assert llm.take() == [("sleep", 2)]  # nothing woken, nothing generated


def test_release_after_reload_without_use_wakes_fully_before_sleeping():
    llm, engine = synced_after_release()
    engine.release_memory()
    assert llm.take() == [("wake_up", ("kv_cache",)), ("sleep", 2)]
    engine.load_weights(iter(WEIGHTS))
    assert llm.take() == [("wake_up", ("weights",)), *RELOAD]


def test_partial_wake_up_is_an_error_not_a_hang():
    llm, engine = synced_after_release(wake_answers_true=False)
    with pytest.raises(RuntimeError, match="still asleep"):
        engine.generate([[1, 2]], SAMPLING)
    assert ("generate",) not in llm.take()


# ---- the real engine on CPU ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback; on CUDA sleep mode is really on")
def test_real_engine_on_cpu_runs_without_sleep_and_takes_the_sleep_order(tiny_policy_dir, caplog):
    site = EngineSite(str(tiny_policy_dir), max_model_len=96, seed=0)
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOG):
        engine = RolloutSettings(sleep_level=2).build_engine(site)
    try:
        assert any("rollout.sleep_level=2 is ignored" in r.getMessage() for r in caplog.records)
        assert engine.sleep_cycle.level == 0
        vllm_core = engine.llm.llm_engine
        tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
        prompt, completion = tok("What is 3+4+5?\n").input_ids, tok("3+4=7,7+5=12.").input_ids
        engine.release_memory()  # level 0 after the fallback: vLLM is not asked to sleep
        assert not vllm_core.is_sleeping()
        assert len(engine.generate([prompt], SamplingConfig(group_size=2, max_tokens=4))[0]) == 2

        # The level-2 order through the real vLLM calls (on CPU its worker keeps the memory, the rest is real).
        engine.sleep_cycle = SleepCycle(engine.llm, 2)
        trainer = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.05 * torch.randn_like(p))
        before = engine.logprobs(prompt, completion)
        engine.release_memory()
        assert vllm_core.is_sleeping()
        engine.load_weights(trainer.state_dict().items())
        assert vllm_core.is_sleeping()  # KV cache still released after the sync's reload
        # Wakes it. A request sent to vLLM's paused scheduler waits for ever (seen when the wake-up is
        # left out), so a hang ends the test process with a traceback instead.
        faulthandler.dump_traceback_later(120, exit=True)
        try:
            after = engine.logprobs(prompt, completion)
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert not vllm_core.is_sleeping()
        from rlvr_lightning.models.forward import sequence_logprobs

        expected = sequence_logprobs(trainer, prompt, completion)
        assert max(abs(a - b) for a, b in zip(after, expected)) < 1e-3  # the reload went through
        assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2
    finally:
        engine.close()


# ---- the call site: once per step, after the rollouts, before the update ----------------------------------


class CallLog:
    """Wraps the real (HF) engine and records which of its methods the training step calls, in order."""

    def __init__(self, engine, calls: list[str]) -> None:
        self.engine, self.calls = engine, calls

    def __getattr__(self, name):
        method = getattr(self.engine, name)

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return recorded


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_training_step_releases_engine_memory_once_between_rollouts_and_update(tiny_policy_dir, algo, monkeypatch):
    from rlvr_lightning.algos.dapo import DAPO
    from rlvr_lightning.algos.grpo import GRPO
    from rlvr_lightning.standalone import standalone
    from rlvr_lightning.training.update import PolicyUpdate

    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None, rollout=RolloutSettings(engine="hf", group_size=2, max_response_length=4))  # fmt: skip
    from tests.support import rewards

    # Scripted correctness (the tiny policy is untrained): DAPO's first round keeps no group, its second does.
    monkeypatch.setattr(rewards, "scripted", rewards.ScriptedScores())  # this test's own count of rounds
    scripted = RewardSettings(correctness="tests.support.rewards.scripted")
    module = standalone(GRPO(rewards=scripted) if algo == "grpo" else DAPO(rewards=scripted), dm)
    try:
        calls: list[str] = []
        module.session.engine = CallLog(module.session.engine, calls)
        run = PolicyUpdate.run
        monkeypatch.setattr(PolicyUpdate, "run", lambda *a, **k: calls.append("update") or run(*a, **k))
        module.train_on_batch(next(iter(dm.train_dataloader())))
        # Every generation round (DAPO's second one too) before the one release; the weight sync loads,
        # then probes the first sync with one log-prob call.
        rounds = ["generate"] * (1 if algo == "grpo" else 2)
        assert calls == [*rounds, "release_memory", "update", "load_weights", "logprobs"]
    finally:
        module.teardown("fit")
