"""Tests of the batch verifier's pool (`rewards.pool.MathVerifier`): verification on the real benchmarks,
perturbations, golds without an answer, the hard-kill timeout path, worker crashes and batching."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import threading
import time
from decimal import Decimal

import pytest

from rlvr_lightning.data.sources import load_problems
from rlvr_lightning.rewards.extraction import normalize_gold
from rlvr_lightning.rewards.pool import MathVerifier
from tests.conftest import BENCHMARKS, needs_benchmarks

NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
# Takes sympy far longer than any timeout (exact 9^(9^9)); math-verify's own SIGALRM
# timeout does stop it, so the hard-kill tests disable that one.
PATHOLOGICAL = "\\boxed{9^{9^{9}}}"


def _load(name: str) -> list[dict]:
    with open(BENCHMARKS / name) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def verifier():
    # Strict, as by default: the benchmark tests below are what keeps strict mode the default. The limits are
    # the default ones; only the retry of an answer that ran out of time is longer (60 s), as a loaded machine
    # can be many times slower than an idle one (the reference solutions take milliseconds each on it).
    with MathVerifier(num_workers=2, timeout_s=5.0, timeout_retry_factor=12, strict=True) as v:
        yield v


def test_gold_without_answer_scores_zero(verifier):
    golds = [None, "\\boxed{3", float("nan"), "3"]
    completions = ["\\boxed{None}", "\\boxed{3}", "\\boxed{nan}", "\\boxed{3}"]
    assert verifier.verify(golds, completions).rewards == [0.0, 0.0, 0.0, 1.0]  # was [1.0, 1.0, 1.0, 1.0]
    assert verifier.parseable_golds(golds) == [False, False, False, True]


def test_list_golds_are_one_answer_or_an_unordered_set(verifier, tmp_path):
    # Lines in OlympiadBench's format: `question`, and `final_answer` as a list of LaTeX strings.
    rows = [{"id": 1, "question": "a?", "final_answer": ["$2$"], "is_multiple_answer": False},
            {"id": 2, "question": "x?", "final_answer": ["$x=1$", "$x=2$"], "is_multiple_answer": True},
            {"id": 3, "question": "pairs?", "final_answer": ["$(1,2)$", "$(3,4)$"], "is_multiple_answer": True},
            {"id": 4, "question": "who?", "final_answer": ["$\\text{Alice}$", "$\\text{Bob}$"], "is_multiple_answer": True}]  # fmt: skip
    path = tmp_path / "olympiad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gold = {r.id: r.answer for r in load_problems(path)}
    scored = {  # (problem id, completion): reward
        ("1", "so \\boxed{2}"): 1.0, ("1", "\\boxed{3}"): 0.0,
        ("2", "\\boxed{x=1, x=2}"): 1.0, ("2", "\\boxed{x = 2 \\text{ or } x = 1}"): 1.0, ("2", "\\boxed{2, 1}"): 1.0,
        ("2", "\\boxed{x=1}"): 0.0, ("2", "\\boxed{x=1, x=3}"): 0.0, ("2", "\\boxed{x=1, x=2, x=3}"): 0.0,
        ("3", "\\boxed{(3,4), (1,2)}"): 1.0, ("3", "\\boxed{(1,2),(3,4)}"): 1.0,
        ("3", "\\boxed{(1,2)}"): 0.0, ("3", "\\boxed{(2,1), (4,3)}"): 0.0,
        ("4", "\\boxed{\\text{Bob}, \\text{Alice}}"): 1.0, ("4", "\\boxed{\\text{Bob}}"): 0.0,
    }  # fmt: skip
    res = verifier.verify([gold[i] for i, _ in scored], [c for _, c in scored])
    assert dict(zip(scored, res.rewards)) == scored
    # A raw list gold is normalised in verify() as well.
    assert verifier.verify([["$1$", "$2$"]] * 2, ["\\boxed{2, 1}", "\\boxed{1}"]).rewards == [1.0, 0.0]


def _replace_last_box(solution: str, old: str, new: str) -> str:
    box = "\\boxed{" + old + "}"
    i = solution.rfind(box)
    assert i >= 0, "the last box of a MATH-500 solution is its answer"
    return solution[:i] + "\\boxed{" + new + "}" + solution[i + len(box) :]


def _plus_one(number: str) -> str:
    return str(Decimal(number) + 1)


@needs_benchmarks
def test_math500_reference_solutions_verify(verifier):
    rows = _load("math500.jsonl")
    res = verifier.verify([r["answer"] for r in rows], [r["solution"] for r in rows])
    failed = [r["unique_id"] for r, x in zip(rows, res.rewards) if x != 1.0]
    assert failed == []
    assert res.num_timeouts == 0 and res.num_no_answer == 0


@needs_benchmarks
def test_gsm8k_reference_solutions_verify(verifier):
    rows = _load("gsm8k.jsonl")
    golds = [normalize_gold(r["answer"]) for r in rows]
    assert all(NUMBER.fullmatch(g) for g in golds)
    res = verifier.verify(golds, [r["answer"] for r in rows])
    failed = [i for i, x in enumerate(res.rewards) if x != 1.0]
    assert failed == []
    assert res.num_timeouts == 0


@needs_benchmarks
def test_aime_amc_golds_verify(verifier):
    rows = _load("aime24.jsonl") + _load("amc23.jsonl")
    golds = [normalize_gold(r["answer"]) for r in rows]
    assert "27" in golds and "025" in [r["answer"] for r in rows]  # AMC23 floats, AIME zero padding
    assert "025" not in golds and "25" in golds
    completions = [f"... so the answer is $\\boxed{{{int(g)}}}$." for g in golds]
    wrong = [f"\\boxed{{{int(g) + 1}}}" for g in golds]
    res = verifier.verify(golds + golds, completions + wrong)
    assert res.rewards == [1.0] * len(golds) + [0.0] * len(golds)


@needs_benchmarks
def test_perturbed_numeric_answers_fail(verifier):
    math_rows = [r for r in _load("math500.jsonl") if NUMBER.fullmatch(r["answer"])]
    gsm_rows = _load("gsm8k.jsonl")
    assert len(math_rows) > 300
    golds, completions = [], []
    for r in math_rows:
        golds.append(r["answer"])
        completions.append(_replace_last_box(r["solution"], r["answer"], _plus_one(r["answer"])))
    for r in gsm_rows:
        gold = normalize_gold(r["answer"])
        golds.append(gold)
        completions.append(r["answer"].rsplit("####", 1)[0] + "#### " + _plus_one(gold))
    res = verifier.verify(golds, completions)
    assert [g for g, x in zip(golds, res.rewards) if x != 0.0] == []
    assert res.num_no_answer == 0


@needs_benchmarks
def test_swapped_non_numeric_answers_fail(verifier):
    rows = _load("math500.jsonl")
    golds, completions, other_golds = [], [], []
    for i, r in enumerate(rows):
        if NUMBER.fullmatch(r["answer"]):
            continue
        # The next item whose gold is a different string.
        other = next(o["answer"] for o in rows[i + 1 :] + rows[:i] if o["answer"] != r["answer"])
        golds.append(r["answer"])
        completions.append(_replace_last_box(r["solution"], r["answer"], other))
        other_golds.append(other)
    assert len(golds) > 150
    res = verifier.verify(golds, completions)
    collisions = [(g, o) for g, o, x in zip(golds, other_golds, res.rewards) if x != 0.0]
    assert collisions == []


def test_hard_kill_timeout_then_pool_still_works():
    # math-verify's own timeouts off: only pebble's wall-clock kill can stop the task, at 1 s and on its retry at 2 s.
    with MathVerifier(num_workers=2, timeout_s=1.0, inner_timeout_s=0, timeout_retry_factor=2) as v:
        v.verify(["1"], ["\\boxed{1}"])  # start the pool outside the timed part
        t0 = time.perf_counter()
        res = v.verify(["5", "3"], [PATHOLOGICAL, "so \\boxed{3}"])
        elapsed = time.perf_counter() - t0
        assert res.rewards == [0.0, 1.0]
        assert res.num_timeouts == 1 and res.num_timeout_retries == 1 and res.num_errors == 0
        assert elapsed < 60.0  # liveness, not speed: 1 s + 2 s of limits, the kills, a respawn and slack
        # The killed worker was replaced: a normal batch still verifies.
        res = v.verify(
            ["\\frac{1}{2}", "7", "x^2+1", "3"],
            ["\\boxed{0.5}", "#### 7", "\\boxed{1+x^2}", "\\boxed{4}"],
        )
        assert res.rewards == [1.0, 1.0, 1.0, 0.0]
        assert res.num_timeouts == 0


def test_math_verify_inner_timeout_ends_in_worker():
    # With math-verify's own timeout (2 s, and 4 s on the retry), the slow case ends inside the worker before
    # the hard kill (5 s, 10 s), which would replace the worker: reward 0, counted as a timeout.
    before = {p.pid for p in multiprocessing.active_children()}
    with MathVerifier(num_workers=1, timeout_s=5.0, timeout_retry_factor=2) as v:
        v.verify(["1"], ["\\boxed{1}"])
        workers = {p.pid for p in multiprocessing.active_children()} - before
        res = v.verify(["5", "4"], [PATHOLOGICAL, "\\boxed{4}"])
        assert res.rewards == [0.0, 1.0]
        assert res.num_timeouts == 1 and res.num_timeout_retries == 1
        assert {p.pid for p in multiprocessing.active_children()} - before == workers  # no worker was killed


def test_worker_crash_is_retried_and_pool_recovers():
    before = {p.pid for p in multiprocessing.active_children()}
    with MathVerifier(num_workers=2, timeout_s=3.0, inner_timeout_s=0) as v:
        v.verify(["1"], ["\\boxed{1}"])
        workers = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
        assert len(workers) == 2
        # Kill this verifier's workers while one is busy with the slow task: a lost worker is no wrong answer,
        # the task is retried (where it runs out of time, the retry of a crash having the first limit).
        killer = threading.Timer(1.0, lambda: [os.kill(pid, signal.SIGKILL) for pid in workers])
        killer.start()
        t0 = time.perf_counter()
        res = v.verify(["5", "3"], [PATHOLOGICAL, "\\boxed{3}"])
        killer.join()
        assert res.rewards == [0.0, 1.0]
        assert res.num_errors >= 1 and res.num_timeouts == 1
        assert time.perf_counter() - t0 < 60.0  # liveness: 1 s, then 3 s, a respawn and slack
        res = v.verify(["2", "3"], ["\\boxed{2}", "\\boxed{3}"])
        assert res.rewards == [1.0, 1.0] and res.num_errors == 0


def test_dedup_order_and_no_answer(verifier, monkeypatch):
    scheduled = []
    run = verifier._run
    monkeypatch.setattr(
        verifier, "_run", lambda pairs, *args, **kwargs: scheduled.extend(pairs) or run(pairs, *args, **kwargs)
    )
    golds = ["4", "4", "4", "4", "\\frac{1}{2}", "4", "9"]
    completions = [
        "\\boxed{4}",
        "so \\boxed{5}",
        "\\boxed{4}",  # same pair as #0
        "no answer at all",
        "\\boxed{0.5}",
        "2+2 \\boxed{4}",  # same pair as #0
        "\\boxed{4}",  # same prediction, other gold: its own task
    ]
    res = verifier.verify(golds, completions)
    assert res.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert res.predictions == ["4", "5", "4", None, "0.5", "4", "4"]
    assert res.num_no_answer == 1 and res.num_timeouts == 0
    expected = [("4", "4", ()), ("4", "5", ()), ("\\frac{1}{2}", "0.5", ()), ("9", "4", ())]
    assert sorted(scheduled) == sorted(expected)


def test_golds_are_normalized_in_verify(verifier):
    res = verifier.verify(["#### 1,234", 27.0], ["\\boxed{1234}", "\\boxed{27}"])
    assert res.rewards == [1.0, 1.0]


def test_long_completion_keeps_the_end(verifier):
    filler = "blah " * 10_000  # 50k chars, over max_completion_chars
    res = verifier.verify(["7", "7"], [filler + "\\boxed{7}", "\\boxed{7}" + filler])
    assert res.predictions == ["7", None]
    assert res.rewards == [1.0, 0.0]
    assert res.num_no_answer == 1


def test_empty_batch(verifier):
    res = verifier.verify([], [])
    assert res.rewards == [] and res.predictions == []
    assert res.num_timeouts == 0 and res.num_no_answer == 0


def test_all_without_answer_starts_no_pool():
    v = MathVerifier()
    res = v.verify(["1", "2"], ["nothing", ""])
    assert res.rewards == [0.0, 0.0] and res.num_no_answer == 2
    assert v._pool is None  # nothing was scheduled
    v.close()


def test_mismatched_lengths_raise(verifier):
    with pytest.raises(ValueError):
        verifier.verify(["1"], [])


def test_close_twice_and_reuse():
    v = MathVerifier(num_workers=1)
    assert v.verify(["3"], ["\\boxed{3}"]).rewards == [1.0]
    v.close()
    v.close()
    # A closed verifier starts a new pool lazily if used again.
    assert v.verify(["3"], ["\\boxed{3}"]).rewards == [1.0]
    v.close()


def test_fork_is_refused():
    with pytest.raises(ValueError):
        MathVerifier(mp_context="fork")
