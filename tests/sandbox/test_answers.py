"""The host believes no answer it did not expect: a worker's answer with a field missing or of another type, a
status no worker gives, more output than the cap, or a message that is not one, is a `crashed` call and the
worker is replaced; nothing is raised out of `Sandbox.run`. A worker that reports something of the call left
is replaced too, its call's answer standing. The worker here (tests/support/fake_worker.py) is a real process
speaking the real protocol."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlvr_lightning.sandbox import Sandbox, SandboxSettings, pool
from tests.support.fake_worker import MALFORMED

FAKE_WORKER = str(Path(__file__).resolve().parents[1] / "support" / "fake_worker.py")


@pytest.fixture
def box(monkeypatch):
    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.setattr(pool, "unisolated_command", lambda preload, uid: [sys.executable, FAKE_WORKER])
    monkeypatch.setenv("PYTHONPATH", repo)
    monkeypatch.setitem(pool.ENVIRONMENT, "PYTHONPATH", repo)  # the worker's environment is fixed
    with Sandbox(SandboxSettings(isolation="none", workers=1, output_bytes=1000)) as sandbox:
        yield sandbox


def worker_pid(box) -> int:
    (worker,) = box._all
    return worker.proc.pid


@pytest.mark.parametrize("malformed", [*MALFORMED, "not JSON", "a length past any answer"])
def test_a_malformed_answer_is_a_crashed_call_and_a_new_worker(box, malformed):
    before = worker_pid(box)
    result = box.run(malformed)
    assert result.status == "crashed" and result.stdout == "", result
    assert worker_pid(box) != before  # replaced
    assert box.run("next").stdout == '"next"\n'  # the new worker serves


def test_a_worker_that_reports_what_was_left_is_replaced_and_its_answer_stands(box):
    before = worker_pid(box)
    result = box.run("a worker that reports what was left")
    assert result.status == "ok" and result.stdout == "1\n"
    assert worker_pid(box) != before


def test_a_well_formed_answer_keeps_its_worker(box):
    before = worker_pid(box)
    assert box.run("fine").stdout == '"fine"\n' and worker_pid(box) == before
