"""Kill-and-resume on 2 FSDP2 ranks (gloo, CPU) through the CLI: a run whose whole process group is
SIGKILLed after a checkpoint leaves a sharded checkpoint directory (one shard per rank), and resumed on
2 ranks it continues the same MLflow run with the metrics of an uninterrupted 2-rank run at every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.cli import REPO
from tests.support.resume import args_for as single_process_args

STEPS, EVAL_EVERY = 4, 2
# Timings differ between any two runs; every other metric is compared.
WALL_CLOCK = ("time/", "throughput/", "val/seconds", "train/verifier_completions_per_s", "system/")  # system: MLflow's machine metrics
CALLBACKS = f"""
trainer:
  callbacks:
    - class_path: rlvr_lightning.callbacks.evaluation.Evaluation
      init_args: {{every_n_steps: {EVAL_EVERY}, num_samples: 2, log_samples: 0}}
    - class_path: rlvr_lightning.callbacks.checkpoint.ResumableCheckpoint
      init_args: {{dirpath: checkpoints, every_n_steps: 1}}
"""


def args_for(run_dir: Path, model_dir: Path) -> list[str]:
    """tests/support/resume.py's run (data, lengths, learning rate) on 2 FSDP ranks, with the callbacks above."""
    (run_dir / "fsdp.yaml").write_text(CALLBACKS)
    args = [
        *single_process_args(run_dir, model_dir), "--config", "configs/strategy/fsdp.yaml",
        "--config", str(run_dir / "fsdp.yaml"), "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--rollout_batches", str(STEPS),
    ]  # fmt: skip
    return [str(REPO / a) if a.startswith("configs/") else a for a in args]


def start(run_dir: Path, args: list[str], log: Path) -> subprocess.Popen:
    """The CLI in a process group of its own: rank 0, the rank-1 process it launches, their verifier workers."""
    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONPATH": str(REPO)}  # for the parity correctness
    with log.open("w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)  # fmt: skip


def fit(run_dir: Path, args: list[str], log: Path) -> None:
    proc = start(run_dir, args, log)
    try:
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]


def kill_after_checkpoint(run_dir: Path, args: list[str], min_step: int) -> Path:
    """Start the CLI and SIGKILL every process of it at once (a lost node, an OOM kill) as soon as a
    checkpoint at step ≥ min_step exists; that checkpoint."""
    proc = start(run_dir, args, run_dir / "killed.log")
    deadline = time.monotonic() + 500
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                (info,) = run_dir.glob("checkpoints/*/last.json")
                if json.loads(info.read_text())["rollout_batches"] >= min_step:
                    break
            except ValueError:  # none yet, or rank 0 is writing it
                pass
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, ("the run ended before it was killed", proc.returncode)
    (ckpt,) = run_dir.glob("checkpoints/*/last.ckpt")
    return ckpt


def histories(run_dir: Path):
    """The one MLflow run of `run_dir` and every metric's history, (timestamp, step, value) in logging
    order, wall-clock ones left out."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert len(runs) == 1, [r.info.run_id for r in runs]  # the resumed run is the same MLflow run
    run = runs[0]
    return run, {
        key: sorted((m.timestamp, m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
        if not key.startswith(WALL_CLOCK)
    }


def latest(history: list[tuple[int, int, float]]) -> dict[int, float]:
    return {step: value for _, step, value in history}  # a step logged again after the resume: its last value


def check_sharded_checkpoint(ckpt: Path, run_id: str) -> int:
    """A distributed checkpoint: each rank wrote its own shard of every policy weight and Adam moment,
    `.metadata` maps them, `meta.pt` holds the rest (loop, module and callback state). The step it holds."""
    from torch.distributed.checkpoint import FileSystemReader

    assert ckpt.is_dir(), ckpt
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    files: dict[str, set[str]] = {}
    for index, info in FileSystemReader(str(ckpt)).read_metadata().storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    weights = [k for k in files if k.startswith("state_dict.policy.")]
    moments = [k for k in files if k.startswith("optimizer_0.state.") and k.endswith(("exp_avg", "exp_avg_sq"))]
    params = {k.removeprefix("state_dict.") for k in weights}
    moment_params = {k.removeprefix("optimizer_0.state.").rsplit(".", 1)[0] for k in moments}
    assert weights and moment_params == params - {"policy.lm_head.weight"}  # tied to the embeddings
    for key in weights + moments:  # half in each rank's file, not gathered and written by one rank
        assert files[key] == {"__0_0.distcp", "__1_0.distcp"}, (key, files[key])
    meta = torch.load(ckpt / "meta.pt", map_location="cpu", weights_only=False)
    assert meta["rlvr"]["mlflow_run_id"] == run_id
    assert json.loads((ckpt.parent / "last.json").read_text())["mlflow_run_id"] == run_id  # what the CLI reads
    (rng,) = [v["rng"] for k, v in meta["callbacks"].items() if k.startswith("ResumableCheckpoint")]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])  # each rank's own generator
    return meta["rlvr"]["rollout_batches"]


@pytest.mark.e2e
def test_killed_two_rank_fsdp_run_resumes_exactly_into_the_same_mlflow_run(tmp_path, tiny_policy_dir):
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference_dir.mkdir(), resumed_dir.mkdir()
    fit(reference_dir, args_for(reference_dir, tiny_policy_dir), reference_dir / "fit.log")

    args = args_for(resumed_dir, tiny_policy_dir)
    ckpt = kill_after_checkpoint(resumed_dir, args, min_step=1)
    k = check_sharded_checkpoint(ckpt, run_id=ckpt.parent.name)  # rollout batches done before the kill
    assert 1 <= k < STEPS, k
    resumed_at = time.time() * 1000
    fit(resumed_dir, [*args, "--ckpt_path", str(ckpt)], resumed_dir / "resumed.log")

    run, resumed = histories(resumed_dir)
    _, reference = histories(reference_dir)
    assert run.info.status == "FINISHED" and run.info.run_id == ckpt.parent.name
    assert min(latest(reference["train/grad_norm"]).values()) > 0  # every step moved weights and moments
    # One point per step: the resumed process trained the steps from the checkpoint on and logged those
    # the killed one had not logged yet, with no extra evaluation.
    for key, history in resumed.items():
        steps = [step for _, step, _ in history]
        assert len(steps) == len(set(steps)), (key, steps)
    before = {key: {step for t, step, _ in history if t < resumed_at} for key, history in resumed.items()}
    after = {key: [step for t, step, _ in history if t >= resumed_at] for key, history in resumed.items()}
    first = max(before["train/policy_version"]) + 1
    assert k <= first and after["train/policy_version"] == list(range(first, STEPS)), (after["train/policy_version"], k)
    assert after["val/accuracy"] == [s for s in range(0, STEPS + 1, EVAL_EVERY) if s > k and s not in before["val/accuracy"]]
    assert sorted(resumed) == sorted(reference)
    differ = []  # (metric, step, resumed, reference); before step k logged by the killed run, from k on resumed
    for key, history in reference.items():
        expected, got = latest(history), latest(resumed[key])
        assert sorted(got) == sorted(expected), key
        differ += [(key, s, got[s], v) for s, v in expected.items() if got[s] != pytest.approx(v, abs=1e-5)]
    assert not differ, (k, differ)
