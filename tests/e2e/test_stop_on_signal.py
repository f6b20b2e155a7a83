"""A run stopped by a signal loses no step: SIGTERM mid-run stops it at the end of the rollout batch in progress
with a checkpoint there, exit code 143, one line naming the checkpoint and the MLflow run closed as KILLED;
resumed from that checkpoint it logs exactly the metrics of an uninterrupted run into the same MLflow run.
SIGINT (Ctrl-C) stops it the same way with 130. A batch that does not end within `--stop.grace_s` (its scoring
waits) is interrupted, and the run stops at its last checkpoint, saying so, within the bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli
from tests.support.resume import COMPARED, histories
from tests.support.rewards import PARITY

STEPS = 6
KEYS = tuple(k for k in COMPARED if not k.startswith("val/"))


def args_for(run_dir: Path, model_dir: Path, *extra: str) -> list[str]:
    (run_dir / "callbacks.yaml").write_text("""
trainer:
  callbacks:
    - class_path: tests.support.rewards.SlowFromBatch
    - class_path: rlvr_lightning.callbacks.checkpoint.ResumableCheckpoint
      init_args: {dirpath: checkpoints, every_n_steps: 0}   # only at the end, and where a signal stops the run
""")
    return ["fit", "--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml",
            "--config", str(run_dir / "callbacks.yaml"), "--rollout_batches", str(STEPS),
            "--trainer.logger.init_args.run_name", "grpo",
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{run_dir}/mlflow.db",
            "--trainer.logger.init_args.artifact_location", str(run_dir / "artifacts"),
            "--data.model_name_or_path", str(model_dir), "--data.val_data", "null", "--rollout.engine", "hf",
            "--data.batch_size", "4", "--rollout.group_size", "4", "--rollout.max_response_length", "16",
            "--model.init_args.optim.lr", "1e-3",
            "--model.init_args.rewards.correctness", PARITY, *extra]  # correctness the quick warm start earns  # fmt: skip


def scored(run_dir: Path) -> int:
    try:
        return int((run_dir / "batches").read_text() or 0)
    except (OSError, ValueError):
        return 0


def stop_with(sig: int, run_dir: Path, args: list[str], after_step: int, env_extra: dict | None = None):
    """Start the CLI, send `sig` once it has scored rollout batch `after_step + 1` (counted in a file: a poll of
    its SQLite store while the run creates it would race its schema migration): (exit code, stderr, seconds
    from the signal to the exit)."""
    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "RLVR_BATCH_COUNT": str(run_dir / "batches"), **(env_extra or {})}  # fmt: skip
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args] + ["--plan.check=false"]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 400
        while scored(run_dir) < after_step + 1 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before the signal: {proc.stderr.read()[-3000:]}"
        proc.send_signal(sig)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def mlflow_run(run_dir: Path):
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    return run


@pytest.mark.e2e
def test_sigterm_stops_at_the_batch_end_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(tmp_path, quick_warm_start):
    _, model_dir = quick_warm_start
    reference_dir, stopped_dir = tmp_path / "reference", tmp_path / "stopped"
    reference_dir.mkdir(), stopped_dir.mkdir()
    proc = run_cli(args_for(reference_dir, model_dir), reference_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]

    args = args_for(stopped_dir, model_dir)
    code, err, seconds = stop_with(signal.SIGTERM, stopped_dir, args, after_step=1)
    assert code == 143, err[-4000:]
    (info,) = stopped_dir.glob("checkpoints/*/last.json")
    k = json.loads(info.read_text())["rollout_batches"]
    ckpt = info.parent / "last.ckpt"
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped by SIGTERM at the end of rollout batch {k}: checkpoint {ckpt.relative_to(stopped_dir)}"), err[-2000:]
    assert 2 <= k < STEPS and "Traceback" not in err, (k, err[-2000:])
    run = mlflow_run(stopped_dir)
    assert run.info.status == "KILLED" and run.data.tags["stopped"] == last

    proc = run_cli([*args, "--ckpt_path", str(ckpt)], stopped_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, resumed = histories(stopped_dir, KEYS)
    _, reference = histories(reference_dir, KEYS)
    for key in KEYS:
        assert resumed[key] == reference[key], (key, k)  # every step, exactly, before and after the stop
    assert run.info.status == "FINISHED"


@pytest.mark.e2e
def test_sigint_stops_the_same_way_and_a_batch_that_waits_is_interrupted_within_the_bound(tmp_path, quick_warm_start):
    _, model_dir = quick_warm_start
    first, second = tmp_path / "sigint", tmp_path / "waits"
    first.mkdir(), second.mkdir()
    code, err, _ = stop_with(signal.SIGINT, first, args_for(first, model_dir), after_step=1)
    assert code == 130 and "stopped by SIGINT at the end of rollout batch" in err.strip().splitlines()[-1], err[-3000:]

    # From the third batch on, scoring waits a minute: a stop must interrupt it within --stop.grace_s.
    args = args_for(second, model_dir, "--stop.grace_s", "3")
    code, err, seconds = stop_with(signal.SIGTERM, second, args, after_step=2, env_extra={"RLVR_SLOW_FROM_BATCH": "2"})
    last = err.strip().splitlines()[-1]
    assert code == 143 and seconds < 3 + 60, (seconds, err[-3000:])
    assert "before the rollout batch in progress ended (the batch did not end within 3 s)" in last, err[-3000:]
    assert mlflow_run(second).info.status == "KILLED"
