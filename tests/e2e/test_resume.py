"""Kill-and-resume: a run killed (SIGKILL) after step k and resumed from its last checkpoint logs
the same metrics for steps k+1..n as an uninterrupted run with the same seed, into the same MLflow run,
with one point per step however many steps ran twice."""

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

STEPS = 5
COMPARED = ("train/reward_mean", "train/accuracy", "train/loss", "train/grad_norm", "train/entropy",
            "train/response_length_mean", "val/accuracy", "val/accuracy_greedy")  # fmt: skip
CALLBACKS = """
trainer:
  callbacks:
    - class_path: rlvr_lightning.callbacks.reward.RewardVerifier
      init_args: {num_workers: 1}
    - class_path: tests.e2e.test_fsdp_resume.ParityReward   # rewards the quick warm start earns, so weights move
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


def kill_after_checkpoint(run_dir: Path, args: list[str], min_step: int) -> int:
    """Start the CLI, SIGKILL it once a checkpoint at step ≥ min_step exists and the MLflow run already
    holds metrics of a step after it (the resumed run trains that step again); the checkpoint's step."""
    import mlflow

    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONPATH": str(REPO)}  # for ParityReward
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            infos = list(run_dir.glob("checkpoints/*/last.json"))
            step = json.loads(infos[0].read_text())["rollout_batches"] if infos else -1
            if step < min_step:
                continue
            client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
            logged = client.get_metric_history(infos[0].parent.name, "train/reward_mean")
            if max(m.step for m in logged) >= step:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait()
    (info,) = run_dir.glob("checkpoints/*/last.json")
    k = json.loads(info.read_text())["rollout_batches"]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    logged = [m.step for m in client.get_metric_history(info.parent.name, "train/reward_mean")]
    assert max(logged) >= k, (logged, k)  # steps after the checkpoint were logged before the kill
    return k


# A LoRA policy synced as an adapter: the checkpoint holds the adapter and its AdamW state, and the resumed
# engine must be handed the adapter it had (the base weights alone would score the same rollouts differently).
LORA = ["--model.init_args.lora.rank", "8", "--model.init_args.lora.sync", "adapter", "--model.init_args.optim.lr", "1e-2"]


# One policy kind here: a single process with a LoRA adapter (its own .ckpt, the in-process engine handed the
# adapter on resume). Full weights resume in tests/e2e/test_fsdp_resume.py (the in-process engine reloaded on two
# ranks, the same checks) and tests/e2e/test_stream_resume.py (one process, a single .ckpt, servers).
@pytest.mark.e2e
@pytest.mark.parametrize("policy", ["lora-adapter"])
def test_killed_run_resumes_exactly_into_the_same_mlflow_run(tmp_path, quick_warm_start, policy):
    _, model_dir = quick_warm_start
    extra = LORA if policy == "lora-adapter" else []
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference_dir.mkdir(), resumed_dir.mkdir()
    proc = run_cli([*args_for(reference_dir, model_dir), *extra], reference_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]

    args = [*args_for(resumed_dir, model_dir), *extra]
    k = kill_after_checkpoint(resumed_dir, args, min_step=2)
    assert 2 <= k < STEPS, k
    _, before = histories(resumed_dir)
    (ckpt,) = resumed_dir.glob("checkpoints/*/last.ckpt")
    proc = run_cli([*args, "--ckpt_path", str(ckpt)], resumed_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]

    run, resumed = histories(resumed_dir)
    _, reference = histories(reference_dir)
    assert run.info.status == "FINISHED" and ckpt.parent.name == run.info.run_id
    assert sorted(resumed["train/reward_mean"]) == list(range(STEPS))  # metrics continue at the right step
    for key in COMPARED:
        assert sorted(resumed[key]) == sorted(reference[key]), key
        for step in [s for s in reference[key] if s > k]:
            assert resumed[key][step] == pytest.approx(reference[key][step], abs=1e-5), (key, step, k)
        for step in [s for s in before[key] if s <= k]:  # what was logged before the kill stays
            assert before[key][step] == pytest.approx(reference[key][step], abs=1e-5), (key, step)
    assert sorted(resumed["val/accuracy"]) == [0, 2, 4, STEPS]  # no extra evaluation on resume


def test_a_checkpoint_from_another_store_resumes_into_a_new_run(tmp_path):
    import mlflow

    from rlvr_lightning.cli.mlflow_resume import mlflow_run_exists

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("x"))
    assert mlflow_run_exists(uri, run.info.run_id)
    assert not mlflow_run_exists(uri, "0" * 32)  # written elsewhere: the CLI warns and opens a new run
