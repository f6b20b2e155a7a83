"""Shared fixtures: tiny HF-format policies built locally, and the vLLM environment for tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cli import REPO

# vLLM on CPU: in-process engine and a small KV cache (it reserves ~16 GiB by default).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The real benchmark files sit in the shared data folder next to the checkout (../shared/data/benchmarks,
# as on the project's CI machines); a clone without it skips the tests that read them.
BENCHMARKS = REPO.parent / "shared" / "data" / "benchmarks"
needs_benchmarks = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason=f"benchmark files not found at {BENCHMARKS}")


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    """An untrained tiny Qwen2 + byte-level tokenizer in HF layout (random weights, fixed seed)."""
    from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy

    tok = build_char_tokenizer()
    model = build_tiny_qwen2(tok, TinyQwen2Spec(num_hidden_layers=2), seed=0)
    return save_policy(model, tok, tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def two_step_runs(tmp_path_factory, quick_warm_start):
    """Two short CLI runs (`tests.cli.TwoStepRuns`) from the quick warm start, which answers some
    held-out problems, so their curves are not flat at 0."""
    from tests.cli import TwoStepRuns

    return TwoStepRuns(tmp_path_factory.mktemp("two_step_runs"), quick_warm_start[1])


@pytest.fixture(scope="session")
def quick_warm_start(tmp_path_factory):
    """A short warm start in a private cache (so tests never depend on, or pollute, the user's cache)."""
    from rlvr_lightning.models.warm_start import WarmStartConfig, embedded_policy_path

    os.environ["RLVR_CACHE_DIR"] = str(tmp_path_factory.mktemp("rlvr_cache"))
    cfg = WarmStartConfig(steps=60, warmup_steps=10)
    return cfg, embedded_policy_path(cfg)
