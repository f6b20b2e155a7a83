"""Kill-and-resume through the CLI: the short run both resume tests train (tests/e2e/test_stream_resume.py in
one process, tests/e2e/test_fsdp_resume.py on two ranks), killing it after a checkpoint, and reading its
MLflow histories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cli import REPO
from tests.support.rewards import PARITY

STEPS = 5
COMPARED = ("train/reward_mean", "train/accuracy", "train/loss", "train/grad_norm", "train/entropy",
            "train/response_length_mean", "val/accuracy", "val/accuracy_greedy")  # fmt: skip
CALLBACKS = """
trainer:
  callbacks:
    - class_path: rlvr_lightning.callbacks.evaluation.Evaluation
      init_args: {every_n_steps: 2, num_samples: 2, log_samples: 0}
    - class_path: rlvr_lightning.callbacks.checkpoint.ResumableCheckpoint
      init_args: {dirpath: checkpoints, every_n_steps: 2}   # the kill lands a whole step after a checkpoint
"""


def args_for(run_dir: Path, model_dir: Path) -> list[str]:
    (run_dir / "callbacks.yaml").write_text(CALLBACKS)
    return [
        "fit", "--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml",
        "--config", str(run_dir / "callbacks.yaml"), "--rollout_batches", str(STEPS),
        "--trainer.logger.init_args.run_name", "grpo",
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{run_dir}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(run_dir / "artifacts"),
        "--data.model_name_or_path", str(model_dir),
        "--data.batch_size", "4", "--rollout.group_size", "4", "--data.val_size", "8", "--rollout.max_response_length", "16",
        "--model.init_args.optim.lr", "1e-3",  # large steps, so a resume that got anything wrong shows in the numbers
        "--model.init_args.rewards.correctness", PARITY,  # correctness the quick warm start earns, so weights move
    ]  # fmt: skip


def histories(run_dir: Path, keys: tuple[str, ...] = COMPARED):
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert len(runs) == 1, [r.info.run_id for r in runs]  # the resumed run is the same MLflow run
    run = runs[0]
    out = {}
    for key in keys:
        points = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in points]
        assert len(steps) == len(set(steps)), (key, sorted(steps))  # one point per step, resumed or not
        out[key] = {m.step: m.value for m in points}
    return run, out


def ready_to_kill(run_dir: Path, min_step: int) -> bool:
    """A checkpoint after ≥ min_step rollout batches exists, and the MLflow run holds metrics of the batch after it."""
    import mlflow

    infos = list(run_dir.glob("checkpoints/*/last.json"))
    step = json.loads(infos[0].read_text())["rollout_batches"] if infos else -1
    if step < min_step:
        return False
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    logged = client.get_metric_history(infos[0].parent.name, "train/reward_mean")
    return max((m.step for m in logged), default=-1) >= step


def kill_after_checkpoint(run_dir: Path, args: list[str], min_step: int) -> int:
    """Start the CLI, SIGKILL it once a checkpoint at step ≥ min_step exists and the MLflow run already
    holds metrics of a step after it (the resumed run trains that step again); the checkpoint's step."""
    import mlflow

    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONPATH": str(REPO)}  # for the parity correctness
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            if not ready_to_kill(run_dir, min_step):
                continue
            # Stopped, the run cannot write a newer checkpoint between the check and the kill: check again.
            proc.send_signal(signal.SIGSTOP)
            if ready_to_kill(run_dir, min_step):
                proc.send_signal(signal.SIGKILL)
                break
            proc.send_signal(signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    (info,) = run_dir.glob("checkpoints/*/last.json")
    k = json.loads(info.read_text())["rollout_batches"]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    logged = [m.step for m in client.get_metric_history(info.parent.name, "train/reward_mean")]
    assert max(logged) >= k, (logged, k)  # steps after the checkpoint were logged before the kill
    return k
