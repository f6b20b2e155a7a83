"""A GRPO run whose answers call the Python tool, as a user runs it: the CLI with `--data.tool.*`, 2 rollout
batches on the real vLLM engine, the code run in the sandbox."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.test_presets import finished_run, preset_args
from tests.support.cli import run_cli
from tests.support.tool_args import BOXED_AS_CALLS


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_grpo_run_whose_answers_call_the_tool(tmp_path, quick_warm_start):
    _, model_dir = quick_warm_start
    # No held-out evaluation: the tool's path in it is `make eval`'s (tests/environments).
    args = [*preset_args(tmp_path, "grpo", model_dir, max_response_length=40), "--rollout_batches", "2", "--data.val_data", "null"]
    proc = run_cli([*args, *BOXED_AS_CALLS], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, history = finished_run(tmp_path, "grpo")
    calls = [p.value for p in history["train/tool_calls_per_answer"]]
    assert len(calls) == 2 and max(calls) > 0
    assert 0 < max(p.value for p in history["train/inserted_token_frac"]) < 1
    for reason in ("answered", "max_calls", "length"):
        assert f"train/stop_{reason}_frac" in history
    ends = sum(history[f"train/stop_{r}_frac"][-1].value for r in ("answered", "max_calls", "length"))
    assert ends == pytest.approx(1.0)
    assert run.data.params["data.tool.max_calls"] == "2" and run.data.params["data.tool.sandbox.isolation"] == "bwrap"
    assert "train/grad_norm" in history
    # Token-in/token-out on vLLM (stop strings, the marker's tokens kept): θ_old's log-probs of every sampled token,
    # in the context of the inserted output tokens, equal the engine's, as without a tool.
    assert max(p.value for p in history["train/logprob_mismatch_max"]) < 1e-3
