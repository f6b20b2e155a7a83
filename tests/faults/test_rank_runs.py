"""Two FSDP2 ranks (gloo, CPU) where rank 1 is killed or frozen mid-run (`make faults`): the run ends within
2 minutes naming rank 1 (not gloo's 30 min wait), nothing of it is left running, and the run resumed from its
last checkpoint has the uninterrupted run's history.

Killed, rank 1's connections close: rank 0's collective fails at once, and its watchdog names the rank whose
heartbeat stopped, unless Lightning's observer of the ranks it launched kills the run first (it polls every 5 s),
naming it "[rank: 1] Child process … terminated". Frozen, rank 1 sends no heartbeat: rank 0's sentinel names it and stops rank 0; rank 1's
sentinel then finds rank 0 gone and kills the frozen rank (`callbacks/rank_watch.py`)."""

from __future__ import annotations

import pytest

from tests.e2e.test_fsdp_resume import STEPS, args_for, histories, latest
from tests.support.faults import run_with_faults

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

FAST = ["--watchdog.rank_unresponsive_s", "15"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_policy_dir):
    run_dir = tmp_path_factory.mktemp("reference")
    result = run_with_faults(args_for(run_dir, tiny_policy_dir), run_dir, [])
    assert result.returncode == 0, result.output[-4000:]
    return histories(run_dir)[1]


@pytest.mark.parametrize("fault", ["kill_rank", "freeze_rank"])
def test_a_lost_rank_is_named_within_two_minutes_and_the_run_resumes_exactly(fault, tmp_path, tiny_policy_dir, reference):
    args = [*args_for(tmp_path, tiny_policy_dir), *FAST]
    result = run_with_faults(args, tmp_path, [(2, fault)])
    assert result.returncode != 0 and result.recovery_s == [None], result.output[-4000:]
    assert result.ended_s < 120, result.ended_s
    assert result.left_running == [], result.left_running
    out = result.output
    if fault == "freeze_rank":
        assert "error: [rank 0] rank 1 stopped answering" in out and "RESUME=" in out, out[-4000:]
        assert "error: [rank 1] the other ranks took this rank for lost" in out  # the frozen rank stopped too
        assert "rank 0 stopped answering" not in out
    else:  # whichever notices first: rank 0's watchdog, or Lightning's observer of the ranks it launched
        assert "error: [rank 0] rank 1 is gone" in out or "[rank: 1] Child process with PID" in out, out[-4000:]

    (ckpt,) = tmp_path.glob("checkpoints/*/last.ckpt")  # intact: the step it holds, written before the fault
    resumed = run_with_faults([*args, "--ckpt_path", str(ckpt)], tmp_path, [])
    assert resumed.returncode == 0, resumed.output[-4000:]
    _, history = histories(tmp_path)
    assert sorted(history) == sorted(reference)
    differ = [(key, s, latest(history[key]).get(s), v) for key, h in reference.items() for s, v in latest(h).items()
              if latest(history[key]).get(s) != pytest.approx(v, abs=1e-5)]  # fmt: skip
    assert not differ, differ
    assert max(latest(history["train/policy_version"])) == STEPS - 1
