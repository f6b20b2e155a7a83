"""Storage faults in whole runs (`make faults`): a checkpoint that cannot be written (the trainer's file-size
limit lowered below the checkpoint's size mid-run, `RLIMIT_FSIZE`: the kernel fails its write as it would on a
full disk, and needs no privilege to mount a small one) and a tracking store locked by another process. The run trains on;
the previous checkpoint stays usable; no metric point is lost; a store locked past its bound is one clear error."""

from __future__ import annotations

import json
import resource
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.support.faults import marker_config
from tests.support.resume import COMPARED, args_for, histories

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS = 5
FILE_LIMIT = 3 << 20  # below the checkpoint (17 MB) and the exported weights (4.4 MB), above the store and the logs


def start(run_dir: Path, model_dir: Path, extra=()):
    import os
    import subprocess
    import sys

    from tests.support.cli import REPO

    args = [*args_for(run_dir, model_dir), "--rollout_batches", str(STEPS), "--plan.check=false",
            "--config", str(marker_config(run_dir / "marker.yaml", run_dir / "steps")), *extra]  # fmt: skip
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = open(run_dir / "run.log", "w")  # noqa: SIM115 - the child writes it
    return subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args], cwd=run_dir, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def test_a_full_disk_keeps_the_previous_checkpoint_and_a_trained_run_finished(tmp_path, quick_warm_start):
    """Checkpoints that cannot be written are dropped (the previous one stays); the final export that cannot be
    written is a warning: the run ends FINISHED, exit 0."""
    exports = tmp_path / "exports.yaml"
    exports.write_text("trainer:\n  callbacks+:\n    - class_path: rlvr_lightning.callbacks.export.HFExport\n")
    proc = start(tmp_path, quick_warm_start[1], ["--config", str(exports)])
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:  # ResumableCheckpoint every 2 steps
            infos = list(tmp_path.glob("checkpoints/*/last.json"))
            if infos and json.loads(infos[0].read_text())["rollout_batches"] == 2:
                proc.send_signal(signal.SIGSTOP)  # stopped: no save can start between the check and the fault
                assert json.loads(infos[0].read_text())["rollout_batches"] == 2, "the steps ran past the fault"
                resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
                proc.send_signal(signal.SIGCONT)
                break
            time.sleep(0.01)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        proc.kill()
    output = (tmp_path / "run.log").read_text()
    for step in (4, STEPS):  # the save every 2 steps, and the one at the end
        assert f"checkpoint at rollout batch {step} not written ([Errno 27] File too large" in output, output[-3000:]
    assert output.count("(rollout batch 2) is intact; training goes on") == 2
    (ckpt,) = tmp_path.glob("checkpoints/*/last.ckpt")
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [
        "last.ckpt",
        "last.json",
        "run.lock",
    ]  # no partial file left
    assert json.loads((ckpt.parent / "last.json").read_text())["rollout_batches"] == 2
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["rlvr"]["rollout_batches"] == 2  # usable
    run, h = histories(tmp_path, ("train/checkpoint_failures", "train/reward_mean", "train/export_failures"))
    assert h["train/checkpoint_failures"] == {4: 1.0, STEPS: 2.0}
    final = tmp_path / "exports" / run.info.run_id / "final"
    assert f"export {Path('exports') / run.info.run_id / 'final'} not written ([Errno 27] File too large" in output, (
        output[-3000:]
    )
    assert f"checkpoint {ckpt.relative_to(tmp_path)} (rollout batch 2) holds the weights" in output, output[-3000:]
    assert run.info.status == "FINISHED" and h["train/export_failures"] == {STEPS: 1.0} and not final.exists()
    assert sorted(h["train/reward_mean"]) == list(range(STEPS))  # every step trained


def lock(db: Path, seconds: float, locked: threading.Event) -> None:
    """Hold an exclusive lock on the SQLite store: every writer and reader waits, then fails."""
    con = sqlite3.connect(db, isolation_level=None, timeout=60)
    con.execute("BEGIN EXCLUSIVE")
    locked.set()
    time.sleep(seconds)
    con.execute("COMMIT")
    con.close()


def test_a_briefly_locked_tracking_store_loses_no_metric_point(tmp_path, quick_warm_start):
    proc = start(tmp_path, quick_warm_start[1])
    locked = threading.Event()
    try:
        while not (tmp_path / "steps" / "step-1").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            time.sleep(0.05)
        holder = threading.Thread(target=lock, args=(tmp_path / "mlflow.db", 45.0, locked))
        holder.start()
        assert proc.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-4000:]
        holder.join()
    finally:
        proc.kill()
    output = (tmp_path / "run.log").read_text()
    assert "the tracking store refused metric points" in output, output[-3000:]
    _, h = histories(tmp_path, COMPARED)
    for key in ("train/reward_mean", "train/loss", "train/grad_norm"):
        assert sorted(h[key]) == list(range(STEPS)), (key, sorted(h[key]))  # every step's point, none lost


def test_a_tracking_store_locked_past_its_bound_stops_the_run_with_one_line(tmp_path, quick_warm_start):
    proc = start(tmp_path, quick_warm_start[1], ["--trainer.logger.init_args.store_unavailable_s", "30"])
    locked = threading.Event()
    try:
        while not (tmp_path / "steps" / "step-1").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            time.sleep(0.05)
        holder = threading.Thread(target=lock, args=(tmp_path / "mlflow.db", 240.0, locked), daemon=True)
        holder.start()
        struck = time.monotonic()
        code = proc.wait(timeout=600)
    finally:
        proc.kill()
    output = (tmp_path / "run.log").read_text()
    assert code == 2, output[-4000:]
    line = next(x for x in output.splitlines() if x.startswith("error: "))
    assert f"the tracking store sqlite:///{tmp_path}/mlflow.db has refused metric points for" in line, line
    assert "store_unavailable_s = 30" in line and "RESUME=" in line
    assert time.monotonic() - struck < 180
