"""A verifier that cannot run must not read as wrong answers: a worker pool that cannot start raises a clear
error, a failure of the pool or of a worker is retried once and counted, and an answer that runs out of time is
retried once with a longer limit before it scores 0. Real worker processes and real math-verify throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.error_lines import user_error_behind
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.pool import CRASHED, MathVerifier, VerifierUnavailable
from rlvr_lightning.rewards.settings import RewardSettings, VerifierSettings
from rlvr_lightning.training.scoring import Scoring
from tests.support.cli import REPO
from tests.support.pool_tasks import count_and_crash, crash_always, crash_once

# A correct answer that takes sympy seconds to verify (it expands both sides): longer than the first limits
# below on any machine, far shorter than their retries on a loaded one.
SLOW_GOLD, SLOW_ANSWER = "(x^2-1)^{250}", "\\boxed{(x+1)^{250}(x-1)^{250}}"

# A script as a user writes one, whose worker processes cannot start: `spawn` re-imports the main script in
# each worker, and this one is gone (a temporary script, a checkout switched under a running job). With
# RESTORE_ON_RETRY it comes back when the verifier says it retries, so only the first pool cannot start.
SCRIPT = """
import json, logging, os, sys
from rlvr_lightning.rewards.pool import MathVerifier, VerifierUnavailable

class PutBackOnRetry(logging.Handler):
    def emit(self, record):
        if "retrying" in record.getMessage() and os.path.exists(AWAY):
            os.rename(AWAY, __file__)

if __name__ == "__main__":
    AWAY = __file__ + ".away"
    os.rename(__file__, AWAY)
    if sys.argv[1] == "RESTORE_ON_RETRY":
        logging.getLogger("rlvr_lightning.rewards.pool").addHandler(PutBackOnRetry())
    with MathVerifier(num_workers=2) as verifier:
        try:
            result = verifier.verify(["3", "4", "3"], ["\\\\boxed{3}", "\\\\boxed{5}", "so \\\\boxed{3}"])
            print(json.dumps({"rewards": result.rewards, "errors": result.num_errors, "timeouts": result.num_timeouts}))
        except VerifierUnavailable as e:
            print(json.dumps({"raised": str(e)}))
"""


def run_script(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_pool_that_cannot_start_raises_instead_of_scoring_zero(tmp_path):
    out = run_script(tmp_path, "GONE")
    assert "raised" in out, out  # was: rewards [0.0, 0.0, 0.0], no timeout, no error
    message = out["raised"]
    assert message.startswith("math verification cannot run: every worker process stopped")
    assert "2 of the 2 distinct answers of this batch were not verified" in message
    assert f"re-import the main script {tmp_path / 'train_script.py'}, which no longer exists" in message
    assert "\n" not in message  # the CLI prints it as one line


def test_a_pool_that_starts_on_the_retry_gives_the_right_rewards_and_counts_the_errors(tmp_path):
    out = run_script(tmp_path, "RESTORE_ON_RETRY")
    assert out == {"rewards": [1.0, 0.0, 1.0], "errors": 3, "timeouts": 0}


def test_the_cli_prints_the_error_as_one_line():
    error = VerifierUnavailable("math verification cannot run: ...")
    try:
        try:
            raise error
        except VerifierUnavailable as e:
            raise RuntimeError("an error Lightning raised while running the callback") from e
    except RuntimeError as wrapped:
        assert user_error_behind(wrapped) is error


# ------------------------------------------------------------------------- a worker lost under a task
@pytest.fixture(scope="module")
def pool():
    with MathVerifier(num_workers=2, timeout_s=60.0) as v:
        yield v


def test_a_worker_lost_under_a_task_is_retried(pool, tmp_path):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    outcome, errored, retried = pool._run_with_retry([(first,), (second,)], crash_once)
    assert outcome == {(first,): True, (second,): True}  # was: False for both, as a wrong answer
    assert errored == {(first,), (second,)} and retried == set()


def test_a_task_that_kills_its_worker_twice_scores_zero_counted(pool):
    outcome, errored, _ = pool._run_with_retry([("crash",), ("fine",)], crash_always)
    assert outcome == {("crash",): CRASHED, ("fine",): True} and errored == {("crash",)}
    with pytest.raises(VerifierUnavailable, match="a worker process died under a task"):  # nothing verified
        pool._run_with_retry([("crash",)], crash_always)
    assert pool.verify(["2"], ["\\boxed{2}"]).rewards == [1.0]  # the pool is still fine


# ------------------------------------------------------------------------------- a slow verification
@pytest.mark.parametrize(
    "limits",
    [
        # pebble's hard kill at 0.5 s (math-verify's own timeout off), then 60 s
        {"timeout_s": 0.5, "inner_timeout_s": 0, "timeout_retry_factor": 120},
        # math-verify's own timeout at 1 s (the hard kill at 60 s), then 60 s
        {"timeout_s": 60.0, "inner_timeout_s": 1, "timeout_retry_factor": 60},
    ],
    ids=["hard-kill", "math-verify-timeout"],
)
def test_an_answer_that_runs_out_of_time_once_is_retried_with_a_longer_limit(limits):
    with MathVerifier(num_workers=1, **limits) as v:
        result = v.verify([SLOW_GOLD, "3"], [SLOW_ANSWER, "\\boxed{4}"])
    assert result.rewards == [1.0, 0.0]  # was [0.0, 0.0]: a slow verification read as a wrong answer
    assert result.num_timeout_retries == 1 and result.num_timeouts == 0 and result.num_errors == 0


def test_without_the_retry_a_timeout_scores_zero_counted():
    with MathVerifier(num_workers=1, timeout_s=0.5, inner_timeout_s=0, timeout_retry_factor=0) as v:
        result = v.verify([SLOW_GOLD], [SLOW_ANSWER])
    assert result.rewards == [0.0] and result.num_timeouts == 1 and result.num_timeout_retries == 0


def test_a_gold_that_is_slow_to_parse_is_not_dropped():
    # The training data is filtered by `parseable_golds`: a gold whose parse runs out of time once is retried.
    gold = " + ".join(f"x^{{{i}}}" for i in range(200))  # seconds to parse
    with MathVerifier(num_workers=1, timeout_s=0.5, inner_timeout_s=0, timeout_retry_factor=120) as v:
        assert v.parseable_golds([gold, "\\{\\text{a}\\}"]) == [True, False]


# ------------------------------------------------------------------------------------ the scoring stage
def test_the_scoring_stage_logs_verifier_errors_and_checks_the_retry_factor():
    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1)))
    try:
        correct, metrics = scoring.verify(["2", "3"], ["\\boxed{2}", "\\boxed{2}"], torch.tensor([False, False]))
        assert correct.tolist() == [1.0, 0.0]
        assert metrics["verifier_errors"] == 0.0 and metrics["verifier_timeouts"] == 0.0
        assert scoring.verifier.timeout_retry_factor == 4.0
    finally:
        scoring.close()
    for factor in (0.5, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="model.rewards.verifier.timeout_retry_factor"):
            VerifierSettings(timeout_retry_factor=factor).check()


def test_a_crash_is_retried_only_once(pool, tmp_path):
    # Both attempts crash: one retry, not a loop (the file counts the attempts).
    counter = tmp_path / "attempts"
    outcome, _, _ = pool._run_with_retry([(str(counter),), ("fine",)], count_and_crash)
    assert outcome[(str(counter),)] == CRASHED and counter.read_text() == "xx"
