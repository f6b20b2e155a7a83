"""A run in a real SLURM job (`make faults`, where `sbatch` reaches a cluster: one node is enough): Lightning's
requeue signal stops it at the end of a rollout batch with a checkpoint there and requeues the job; the requeued
job resumes from that checkpoint into the same MLflow run, and every step is logged once (`slurm_requeue.py`)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.support.cli import REPO
from tests.support.faults import marker_config
from tests.support.resume import args_for, histories

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


def slurm_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0


def job_state(job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", shown))


@pytest.mark.skipif(not slurm_up(), reason="no SLURM cluster answers here (sinfo)")
def test_a_requeued_slurm_job_resumes_the_same_run_from_its_checkpoint(tmp_path, quick_warm_start):
    args = [*args_for(tmp_path, quick_warm_start[1]), "--rollout_batches", "6", "--plan.check=false",
            "--config", str(marker_config(tmp_path / "marker.yaml", tmp_path / "steps"))]  # fmt: skip
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=1 --requeue --open-mode=append\n"
        f"export RLVR_CACHE_DIR={tmp_path / 'cache'} PYTHONUNBUFFERED=1 PYTHONPATH={REPO}\n"
        f"srun {shlex.quote(sys.executable)} -m rlvr_lightning {shlex.join(args)}\n"
    )
    log = tmp_path / "job.log"
    submitted = subprocess.run(["sbatch", "--parsable", "-D", str(tmp_path), "-o", str(log), str(script)],
                               capture_output=True, text=True, check=True)  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for_step_in_job(tmp_path / "steps", 2, job)
        subprocess.run(["scancel", "--signal=USR1", job], check=True)  # what `#SBATCH --signal=USR1@90` sends
        deadline = time.monotonic() + 900
        while (state := job_state(job)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline, state
            time.sleep(2)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    output = log.read_text(errors="replace")
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, output[-4000:])
    stopped = next(x for x in output.splitlines() if x.startswith("stopped by SIGUSR1 at the end of rollout batch"))
    assert f"; SLURM job {job} requeued, to resume from its last checkpoint" in stopped, stopped
    checkpoint = re.search(r"checkpoint (\S+last\.ckpt) holds it", stopped).group(1)
    assert f"SLURM job {job} was requeued: resuming from {checkpoint}" in output, output[-4000:]
    run, h = histories(tmp_path, ("train/reward_mean", "train/loss"))  # one MLflow run, one point per step
    assert sorted(h["train/reward_mean"]) == list(range(6)) and run.info.status == "FINISHED", (h, run.info.status)


def wait_for_step_in_job(marks, step: int, job: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not (marks / f"step-{step}").exists():
        state = job_state(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state} before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout:.0f} s"
        time.sleep(0.2)
