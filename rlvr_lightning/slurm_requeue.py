"""A SLURM job that is requeued (preempted with `--requeue`, a node lost, or requeued by the run itself on
Lightning's requeue signal) resumes from its run's checkpoint, into the same MLflow run.

Lightning's own requeue support (`SLURMEnvironment(auto_requeue=True)`, its `requeue_signal`, SIGUSR1 by
default: `#SBATCH --signal=USR1@90`) saves an `hpc_ckpt_<n>.ckpt` from inside the signal handler, mid-step, marks
the MLflow run finished and requeues; the requeued job restores that file without the run's MLflow run or
its checkpoint directory. Here the same signal stops the run as SIGTERM does, at the end of the rollout batch
with a checkpoint there (`callbacks/stopping.py`), then requeues the job (`scontrol requeue`); and each job
records which checkpoint it writes (`checkpoints/slurm-<job id>.json`, `record_job_checkpoint`), so the requeued
job, started again by SLURM with the same command line, resumes from it (`requeued_checkpoint`, the CLI) whichever
way it ended.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def slurm_job() -> str | None:
    """This process's SLURM job (`<array job>_<task>` for an array task), or None outside SLURM."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def job_record(checkpoints_dir: str | os.PathLike, job: str) -> Path:
    return Path(checkpoints_dir) / f"slurm-{job}.json"


def record_job_checkpoint(checkpoints_dir: str | os.PathLike, checkpoint: Path, mlflow_run_id: str | None) -> None:
    """Say which checkpoint this SLURM job's run writes, for the job's next start after a requeue."""
    job = slurm_job()
    if job is None:
        return
    path = job_record(checkpoints_dir, job)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"job": job, "checkpoint": str(checkpoint), "mlflow_run_id": mlflow_run_id}))
    os.replace(tmp, path)


def requeued_checkpoint(checkpoints_dir: str | os.PathLike) -> str | None:
    """The checkpoint this SLURM job's earlier start wrote, if it is a requeued job and one was written."""
    job = slurm_job()
    if job is None:
        return None
    try:
        checkpoint = json.loads(job_record(checkpoints_dir, job).read_text())["checkpoint"]
    except (OSError, ValueError, KeyError):
        return None
    return checkpoint if Path(checkpoint).exists() else None


def requeue() -> str:
    """`scontrol requeue` this job: what SLURM answered, in a few words."""
    job = slurm_job()
    if job is None:
        return "not a SLURM job: not requeued"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`scontrol requeue {job}` failed: {err}"
    if done.returncode != 0:
        return f"`scontrol requeue {job}` failed: {(done.stderr or done.stdout).strip()[:200]}"
    return f"SLURM job {job} requeued"
