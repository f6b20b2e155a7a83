"""One process per run (`run_lock.py`): a second process on a locked run directory is refused in one line naming
the holder; the lock goes with its holder, however it ends."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rlvr_lightning.run_lock import LOCK_NAME, RunInUse, hold_run_directory, release_run_directory

HOLD = "import sys, time; from rlvr_lightning.run_lock import hold_run_directory; hold_run_directory(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def test_a_second_process_on_a_held_run_is_refused_naming_the_holder_until_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunInUse) as refused:
            hold_run_directory(tmp_path)
        message = str(refused.value)
        assert f"in use by process {holder.pid} on {socket.gethostname()}" in message and "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    hold_run_directory(tmp_path)  # killed, not cleaned up after: the kernel gave its lock back
    hold_run_directory(tmp_path)  # this process again: it already holds it
    assert '"pid": ' in (tmp_path / LOCK_NAME).read_text()
    release_run_directory(tmp_path)


def test_store_creation_takes_turns(tmp_path):
    """Two processes opening one new SQLite store at once: MLflow's schema migration runs in one of them, then the
    other opens the migrated store (unserialised, the second died in 'table _alembic_tmp_metrics already exists')."""
    code = ("import sys; from rlvr_lightning.tracking import MLFlowLogger; "
            "l = MLFlowLogger(experiment_name='x', tracking_uri=f'sqlite:///{sys.argv[1]}/mlflow.db', system_metrics=False); "
            "l.log_metrics({'m': 1.0}, step=0); l.finalize('success')")  # fmt: skip
    for attempt in range(2):  # unserialised, every attempt here failed one of the two
        store = tmp_path / str(attempt)
        store.mkdir()
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(store)], stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        assert all(rc == 0 for rc, _ in results), [err[-2000:] for _, err in results]
