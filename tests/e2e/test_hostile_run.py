"""A training run whose answers call the Python tool, every call a hostile program (tests/support/hostile.py):
the run finishes, the programs ran and were stopped in the sandbox, and the file and process outside that they
aimed at are untouched (the hostile programs one by one, with what contains each: tests/sandbox)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.e2e.test_presets import finished_run, preset_args
from tests.support.cli import run_cli
from tests.support.hostile import hostile_programs

SECRET = "rlvr-secret-5b2e81"


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_training_run_whose_calls_are_hostile_goes_on(tmp_path, quick_warm_start, monkeypatch):
    _, model_dir = quick_warm_start
    # Anyone may write the canary file (and reach it: /tmp), so that only the sandbox's own /tmp keeps it from a call.
    shared = Path(tempfile.mkdtemp(prefix="rlvr-canary-", dir="/tmp"))
    shared.chmod(0o777)
    canary_file = shared / "canary.txt"
    canary_file.write_text("untouched")
    canary_file.chmod(0o666)
    canary = subprocess.Popen(["sleep", "600"])
    try:
        monkeypatch.setenv("RLVR_HOSTILE_CANARY_FILE", str(canary_file))
        monkeypatch.setenv("RLVR_HOSTILE_CANARY_PID", str(canary.pid))
        monkeypatch.setenv("RLVR_TEST_SECRET_TOKEN", SECRET)  # the trainer's environment
        args = [*preset_args(tmp_path, "grpo", model_dir, max_response_length=40), "--rollout_batches", "5",
                "--data.val_data", "null", "--rollout.engine", "hf", "--data.environment", "tests.support.hostile.HostileCalls"]  # fmt: skip
        proc = run_cli(args, tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert canary.poll() is None and canary_file.read_text() == "untouched"
        if Path("/proc/keys").exists():  # a kernel key a call made would outlive the run, on this machine
            assert "rlvr-leak" not in Path("/proc/keys").read_text()
    finally:
        canary.kill()
        canary.wait()
        shutil.rmtree(shared)
    run, history = finished_run(tmp_path, "grpo")
    calls = sum(p.value for p in history["train/tool_calls_per_answer"]) * 16  # 16 answers a batch
    assert calls >= len(hostile_programs("", 0)), calls  # every program ran at least once
    assert max(p.value for p in history["train/tool_timeout_frac"]) > 0  # the loops and bombs were stopped
    assert max(p.value for p in history["train/tool_error_frac"]) > 0
    assert len(history["train/loss"]) == 5 and "train/grad_norm" in history  # every batch trained
    logged = [p.read_text(errors="replace") for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
    assert logged and not any(SECRET in text for text in logged)
