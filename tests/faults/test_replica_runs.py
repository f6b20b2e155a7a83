"""Whole runs on a launched `vllm serve` replica that is killed or frozen mid-run (`make faults`): the run
completes every step, counts the restart, and in the reproducible stream (two versions ahead, partial rollouts)
its metric history is the uninterrupted run's, bit for bit."""

from __future__ import annotations

import pytest

from tests.support.faults import run_with_faults
from tests.support.resume import COMPARED, args_for, histories

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

STEPS = 6
SERVED = ["--rollout.engine", "vllm-server", "--rollout.stream.max_staleness", "2", "--rollout.stream.partial_rollouts", "true",
          "--rollout_batches", str(STEPS)]  # fmt: skip


def run(tmp_path_factory, model_dir, name: str, faults, extra=()):
    run_dir = tmp_path_factory.mktemp(name)
    return run_dir, run_with_faults([*args_for(run_dir, model_dir), *SERVED, *extra], run_dir, faults)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, quick_warm_start):
    run_dir, result = run(tmp_path_factory, quick_warm_start[1], "uninterrupted", [])
    assert result.returncode == 0, result.output[-4000:]
    return histories(run_dir, (*COMPARED, "train/replica_restarts"))[1]


def test_a_replica_killed_twice_leaves_the_history_unchanged(tmp_path_factory, quick_warm_start, uninterrupted):
    run_dir, result = run(tmp_path_factory, quick_warm_start[1], "killed", [(2, "kill_replica"), (4, "kill_replica")])
    assert result.returncode == 0, result.output[-4000:]
    assert result.output.count("restarting it and sending its requests again") == 2, result.output[-4000:]
    _, faulted = histories(run_dir, (*COMPARED, "train/replica_restarts"))
    expected = dict(uninterrupted)
    assert faulted.pop("train/replica_restarts")[STEPS - 1] == 2.0
    assert expected.pop("train/replica_restarts")[STEPS - 1] == 0.0
    assert faulted == expected
    print(f"killed replica: next step {result.recovery_s} s after each kill")


def test_a_frozen_replica_is_restarted_and_the_history_unchanged(tmp_path_factory, quick_warm_start, uninterrupted):
    run_dir, result = run(tmp_path_factory, quick_warm_start[1], "frozen", [(2, "freeze_replica")],
                          extra=["--rollout.servers.unresponsive_s", "10"])  # fmt: skip
    assert result.returncode == 0, result.output[-4000:]
    assert "has not answered a health check for" in result.output, result.output[-4000:]
    _, faulted = histories(run_dir, (*COMPARED, "train/replica_restarts"))
    expected = dict(uninterrupted)
    assert faulted.pop("train/replica_restarts")[STEPS - 1] == 1.0
    expected.pop("train/replica_restarts")
    assert faulted == expected
    assert result.recovery_s[0] is not None and result.recovery_s[0] < 120
    print(f"frozen replica: next step {result.recovery_s[0]:.0f} s after the freeze")
