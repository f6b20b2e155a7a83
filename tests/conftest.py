"""Shared fixtures: tiny HF-format policies built locally, and the vLLM environment for tests."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import rlvr_lightning  # noqa: F401  (first: it pins the CPU kernels before any test computes)
from tests.support.cli import REPO

# vLLM on CPU: in-process engine and a small KV cache (it reserves ~16 GiB by default).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The real benchmark files sit in the shared data folder next to the checkout (../shared/data/benchmarks,
# as on the project's CI machines); a clone without it skips the tests that read them.
BENCHMARKS = REPO.parent / "shared" / "data" / "benchmarks"
needs_benchmarks = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason=f"benchmark files not found at {BENCHMARKS}")


def pytest_collection_modifyitems(config, items):
    """The files with the most end-to-end runs first, the rest after them by their number of tests (as
    pytest-xdist's own order). `make test` hands whole files to its workers in this order
    (`--dist loadfile --no-loadscope-reorder`): the long runs start early and short files fill the end, where
    xdist's own order (by number of tests) left a two-minute run for last while the other worker idled."""
    from collections import Counter

    e2e = Counter(item.path for item in items if item.get_closest_marker("e2e"))
    tests = Counter(item.path for item in items)
    items.sort(key=lambda item: (-e2e[item.path], -tests[item.path], str(item.path)))  # stable within a file


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 + byte-level tokenizer in HF layout (random weights, fixed seed)."""
    from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy

    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, TinyQwen2Spec(num_hidden_layers=2), seed=0)
    return save_policy(model, tok, tmp_path_factory.mktemp("tiny_policy"))


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder every test process of this session shares (pytest-xdist's workers each have a base temp of
    their own under one parent): what is built there under a file lock is built once, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def two_step_runs(tmp_path_factory, quick_warm_start):
    """Two short CLI runs (`tests.support.cli.TwoStepRuns`) from the quick warm start, which answers some
    held-out problems, so their curves are not flat at 0; trained once for all the session's workers."""
    from tests.support.cli import TwoStepRuns

    return TwoStepRuns(shared_dir(tmp_path_factory, "two_step_runs"), quick_warm_start[1])


@pytest.fixture(scope="session")
def quick_warm_start(tmp_path_factory):
    """A short warm start in a cache of the test session's own (so tests never depend on, or pollute, the
    user's cache), built once for all its workers (`embedded_policy_path` builds under a file lock)."""
    from rlvr_lightning.models.warm_start import WarmStartConfig, embedded_policy_path

    os.environ["RLVR_CACHE_DIR"] = str(shared_dir(tmp_path_factory, "rlvr_cache"))
    cfg = WarmStartConfig(steps=60, warmup_steps=10)
    return cfg, embedded_policy_path(cfg)


# ---- a module whose rollout batches run ahead (rollout.stream.max_staleness), without servers ------------------------


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
            time.sleep(0.5)
            self.events.append("ahead generated")
        return groups

    def load_weights(self, weights, version=None):
        self.events.append("load_weights")
        self.model.load_state_dict(dict(weights), strict=False)


@pytest.fixture
def lagged_module(tiny_policy_dir):
    """GRPO with rollouts generated ahead (`rollout.stream.max_staleness`, which the settings allow only with
    servers) from a `SlowAheadServer`: the step's code path is the same whatever engine generates."""
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.rollout.settings import RolloutSettings, StreamSettings
    from rlvr_lightning.standalone import standalone

    def build(max_staleness=1, partial_rollouts=False, module_class=GRPO, callbacks=(), stream_mode="reproducible",
              stale_groups="hold", **model_kwargs):  # fmt: skip
        rollout = RolloutSettings(engine="hf", group_size=2, max_response_length=4)
        rollout.stream = StreamSettings(max_staleness, partial_rollouts, stream_mode, stale_groups)  # as a server run's
        dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None, rollout=rollout)
        return standalone(module_class(**model_kwargs), dm, callbacks=[*callbacks])

    built = []

    def with_server(**kw):
        module = build(**kw)
        module.events = []
        module.session.engine = SlowAheadServer(module.policy, module.trainer.datamodule.tokenizer, module.events)
        built.append(module)
        return module

    yield with_server
    for module in built:
        module.teardown("fit")
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")
