"""A whole run whose generation freezes (its one `vllm serve` replica stopped, with the health checks' bound set
past the watchdog's): the watchdog stops it with every thread's stack and the rollout's state in its log and its
MLflow run, and the run resumes from its last checkpoint; SIGTERM in the same wait stops it within `stop.grace_s`
(`make faults`)."""

from __future__ import annotations

import time

import pytest

from tests.support.faults import run_with_faults
from tests.support.resume import args_for

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


def test_a_frozen_generation_is_stopped_by_the_watchdog_with_the_stacks(tmp_path, quick_warm_start):
    args = [*args_for(tmp_path, quick_warm_start[1]), "--rollout.engine", "vllm-server", "--rollout_batches", "6",
            "--rollout.servers.unresponsive_s", "3600", "--watchdog.stall_s", "20"]  # fmt: skip
    start = time.monotonic()
    result = run_with_faults(args, tmp_path, [(2, "freeze_replica")])
    assert result.returncode == 2, result.output[-4000:]
    assert result.recovery_s == [None]  # no step after the freeze
    assert time.monotonic() - start < 300  # started, stalled 20 s after step 2, stopped: no wait left behind
    assert "watchdog: the first step may take 1800 s, each later one 20 s" in result.output
    line = next(x for x in result.output.splitlines() if x.startswith("error: "))
    assert "no training step finished for" in line and "watchdog.stall_s" in line and "RESUME=" in line, line
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
    report = open(client.download_artifacts(run.info.run_id, "watchdog/stall.txt", str(tmp_path))).read()
    # The engine's state names the frozen replica; the stacks show the main thread waiting on the generation.
    assert "engine: vllm-server, version 2" in report and "alive" in report, report[:2000]
    assert "--- thread MainThread" in report and "generate" in report
    assert "scoring: math-verify pool" in report


def test_sigterm_while_a_step_waits_on_a_frozen_replica_stops_within_the_bound(tmp_path, quick_warm_start):
    """SIGTERM (a preemption) while the step waits on a frozen replica that nothing else would end for an hour:
    the run stops `stop.grace_s` later at its last checkpoint, says so in one line, exits 143, MLflow KILLED."""
    args = [*args_for(tmp_path, quick_warm_start[1]), "--rollout.engine", "vllm-server", "--rollout_batches", "6",
            "--rollout.servers.unresponsive_s", "3600", "--stop.grace_s", "5"]  # fmt: skip
    result = run_with_faults(args, tmp_path, [(2, "freeze_replica_then_stop")])
    assert result.returncode == 143, result.output[-4000:]
    assert result.ended_s < 3 + 5 + 30, result.ended_s  # frozen 3 s before the signal, the grace, the unwinding
    (ckpt,) = tmp_path.glob("checkpoints/*/last.ckpt")
    line = next(x for x in result.output.splitlines() if x.startswith("stopped by SIGTERM"))
    assert line.startswith("stopped by SIGTERM before the rollout batch in progress ended (the batch did not end "
                           f"within 5 s): the last checkpoint {ckpt.relative_to(tmp_path)} holds rollout batch 2"), line  # fmt: skip
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["stopped"] == line
