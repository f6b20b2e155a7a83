"""The MLflow logger of a resumed run logs each metric once per step; a full store's warning names its cause and a
read-only one is one line at start (real MLflow stores, real file systems)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from rlvr_lightning.tracking import MLFlowLogger
from tests.support.cli import REPO


def test_a_logger_continuing_a_run_skips_the_steps_the_run_already_holds(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLFlowLogger(experiment_name="x", tracking_uri=uri, artifact_location=str(tmp_path / "a"))
    for step in range(4):  # killed after logging step 3; its last checkpoint was at step 2
        first.log_metrics({"train/loss": float(step), "val/accuracy": 0.5}, step=step)
    first.log_metrics({"train/only_late": 1.0}, step=3)

    resumed = MLFlowLogger(experiment_name="x", tracking_uri=uri, run_id=first.run_id)
    for step in range(2, 6):  # steps 2 and 3 are trained again
        resumed.log_metrics({"train/loss": 10.0 + step, "train/new": 1.0}, step=step)
    resumed.log_metrics({"train/only_late": 2.0}, step=2)  # before that metric's last step: skipped
    resumed.log_metrics({"val/accuracy": 0.7}, step=5)

    client = first.experiment
    points = {key: sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, key))
              for key in ("train/loss", "train/new", "val/accuracy", "train/only_late")}  # fmt: skip
    assert points["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]
    assert points["train/new"] == [(s, 1.0) for s in range(2, 6)]  # a metric the run did not have: all kept
    assert points["val/accuracy"] == [(s, 0.5) for s in range(4)] + [(5, 0.7)]
    assert points["train/only_late"] == [(3, 1.0)]


def test_a_new_run_logs_every_point(tmp_path):
    logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    logger.log_metrics({"m": 1.0}, step=0)
    logger.log_metrics({"m": 2.0}, step=0)  # not a resume: the logger does not second-guess the caller
    assert len(logger.experiment.get_metric_history(logger.run_id, "m")) == 2


def test_system_metrics_are_logged_while_the_run_is_open(tmp_path):
    import time

    logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", system_metrics_interval_s=0.2)
    run_id = logger.run_id  # opening the run starts the monitor

    def samples():
        return logger._mlflow_client.get_metric_history(run_id, "system/cpu_utilization_percentage")

    deadline = time.monotonic() + 60  # a busy machine delays the monitor's thread, never stops it
    while len(samples()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    logger.finalize("success")
    history = samples()
    assert len(history) >= 2 and all(0 <= m.value <= 100 for m in history)
    assert "system/system_memory_usage_megabytes" in logger._mlflow_client.get_run(run_id).data.metrics
    quiet = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", system_metrics=False)
    _ = quiet.run_id
    quiet.finalize("success")
    assert not [k for k in quiet._mlflow_client.get_run(quiet.run_id).data.metrics if k.startswith("system/")]


# ---- a store that is full or read-only: a real file system, mounted in a user namespace of the test's own --------

LOG_UNTIL_REFUSED = """
import sys
from rlvr_lightning.tracking import MLFlowLogger
logger = MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{sys.argv[1]}/mlflow.db", system_metrics=False,
                      store_unavailable_s=0.5)
for step in range(100000):
    logger.log_metrics({f"metric_{i}": float(step) for i in range(50)}, step=step)
"""


def in_own_mounts(tmp_path, mounts: str, code: str, store) -> subprocess.CompletedProcess:
    """`code` run after `mounts` (shell), in a mount namespace of its own (an unprivileged user namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    script = tmp_path / "script.py"
    script.write_text(code)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mounts} && exec "$0" "$1" "$2"', sys.executable, str(script), str(store)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    if "unshare failed" in proc.stderr or "mount: " in proc.stderr:
        pytest.skip(f"this machine allows no user namespace mounts: {proc.stderr.strip()[:200]}")
    return proc


def test_a_full_store_is_named_by_its_cause(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    proc = in_own_mounts(tmp_path, f"mount -t tmpfs -o size=2m tmpfs {store}", LOG_UNTIL_REFUSED, store)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("the tracking store refused")]
    assert warnings and proc.returncode != 0, proc.stderr[-3000:]
    assert warnings[0].startswith("the tracking store refused metric points (database or disk is full); 1 steps'"), (
        warnings[0]
    )
    assert "; last: database or disk is full)" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_a_read_only_store_is_one_line_at_start(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    MLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{store}/mlflow.db", system_metrics=False).finalize(
        "success"
    )
    code = "import sys\nfrom rlvr_lightning.tracking import MLFlowLogger\nMLFlowLogger(tracking_uri=f'sqlite:///{sys.argv[1]}/mlflow.db')"
    proc = in_own_mounts(tmp_path, f"mount --bind {store} {store} && mount -o remount,bind,ro {store}", code, store)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith(
        f"rlvr_lightning.errors.ConfigError: trainer.logger: the tracking store sqlite:///{store}/mlflow.db cannot be opened for writing ("
    ), proc.stderr[-2000:]
    assert "Read-only file system" in last, last
