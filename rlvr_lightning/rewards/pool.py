"""The hardened math answer verifier: the reward of RL training and the metric of evaluation.

A completion's answer is extracted in the parent with plain string operations (`rewards.extraction`) and
compared with the gold answer by math-verify (`rewards.verification`) in a persistent pool of worker
processes (`MathVerifier`, running the tasks of `rewards.pool_tasks`).

Why processes with a hard kill, and not threads or an in-process call:

* sympy can take effectively forever (or blow up memory) on inputs a policy will
  eventually produce, e.g. ``9^{9^{9}}`` compared with an integer. Reward computation
  runs every training step, so one such completion must not stall training.
* math-verify's own timeouts use ``signal.alarm`` (SIGALRM). Signals are only delivered
  to the main thread, so they cannot work inside a thread pool, nor in a trainer whose
  reward runs off the main thread; and a handler never runs while the interpreter is
  stuck inside one long C call. Their ``TimeoutException`` also derives from
  ``BaseException``, so ``except Exception`` does not catch it.
* So each (gold, prediction) pair is one task in a ``pebble.ProcessPool`` with a
  wall-clock ``timeout``: pebble kills a worker whose task overruns and starts a new
  one. The worker still passes math-verify's own (shorter) timeouts, so most slow cases
  end cleanly inside the worker, which is cheaper than killing and respawning it.
* Workers are started with 'spawn' (or 'forkserver'), never 'fork': the trainer holds
  torch/OpenMP threads and an in-process vLLM engine, which fork does not copy safely.
  (As with any spawn pool, a script using it needs an ``if __name__ == "__main__":`` guard.)
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import pebble

from rlvr_lightning.rewards.extraction import extract_prediction, gold_or_none, other_boxed_answers
from rlvr_lightning.rewards.pool_tasks import gold_task, verify_task, worker_init
from rlvr_lightning.rewards.verification import TIMEOUT

logger = logging.getLogger(__name__)


# What a pool task can end in besides True / False / TIMEOUT. Neither is the answer's fault: the task is
# retried once (`MathVerifier._run_with_retry`).
CRASHED = "crashed"  # its worker died under it (a segfault, an OOM kill, a kill from outside) or it failed to run
BROKEN = "broken"  # the pool failed: no worker could start, every worker died, or none answered in time


class VerifierUnavailable(RuntimeError):
    """Math verification could not run: its worker processes could not start, or kept dying, twice. The answers
    were not verified, which must not read as wrong answers; the message names the cause and what to do."""


@dataclass
class VerifyResult:
    rewards: list[float]  # 1.0 correct / 0.0 otherwise, in input order
    predictions: list[str | None]  # extracted answer per completion
    # completions whose verification ran out of time (the hard kill or math-verify's own timeout) at the
    # longer limit of its retry too, or at the first one when the retry is off
    num_timeouts: int
    num_no_answer: int  # completions with no extractable answer
    seconds: float
    num_multiple_boxed: int = 0  # completions that boxed two or more different strings
    # completions whose verification met a failure of the pool or of its worker and was retried (counted
    # whether or not the retry verified it; scored 0 only when its worker died under it twice)
    num_errors: int = 0
    num_timeout_retries: int = 0  # completions retried with the longer limit after running out of time once


class MathVerifier:
    """Verifies batches of completions against gold answers in a persistent process pool.

    The pool starts on first use and is reused; use as a context manager or call close().
    `inner_timeout_s` is math-verify's own timeout (None: derived from `timeout_s`;
    0: disabled, which leaves only the hard kill, as tests of that path need).
    `timeout_retry_factor`: a verification that runs out of time (either limit) is not a wrong answer yet, as a
    loaded machine is slow: it is retried once with both limits this many times longer, and scores 0 (counted
    in `num_timeouts`) only if it runs out of time again; 0 scores it 0 at once.
    A failure of the pool itself (its workers cannot start or die, e.g. a main script that `spawn` cannot
    re-import, an OOM kill) is not a wrong answer either: the task is retried once on a new pool (counted in
    `num_errors`), and when that fails too `verify` raises `VerifierUnavailable`; a task whose worker dies
    under it twice scores 0, unless no task of the batch could be verified (then it raises too).
    `multiple_boxed`: "wrong" requires every boxed answer of a completion to equal the gold (see
    `other_boxed_answers`; more than `max_other_boxes` different ones score 0 at once); "last" grades
    the last box only.
    `strict`: an answer counts only if math-verify reads it whole as LaTeX (`verification._parse_strict`), not by
    picking a number or fragment out of text it cannot parse. On by default: every reference answer
    of MATH-500, AIME24, AMC23 and GSM8K still verifies in it (tests/rewards/test_pool.py).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        max_completion_chars: int = 20000,
        *,
        inner_timeout_s: int | None = None,
        timeout_retry_factor: float = 4.0,
        mp_context: str = "spawn",
        multiple_boxed: str = "wrong",
        max_other_boxes: int = 3,
        strict: bool = True,
    ):
        if mp_context == "fork":
            raise ValueError("fork is unsafe next to torch/vLLM threads; use spawn or forkserver")
        if multiple_boxed not in ("wrong", "last"):
            raise ValueError(f"multiple_boxed={multiple_boxed!r}; valid: wrong, last")
        if timeout_retry_factor != 0 and not timeout_retry_factor >= 1:
            raise ValueError(f"timeout_retry_factor={timeout_retry_factor!r}; valid: 0 (no retry) or at least 1")
        self.multiple_boxed, self.max_other_boxes = multiple_boxed, max_other_boxes
        self.strict = strict
        self._gold_ok: dict[str, bool] = {}  # gold -> parseable, checked once per distinct gold
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.timeout_retry_factor = timeout_retry_factor
        self.max_completion_chars = max_completion_chars
        # Below the hard limit so that most slow cases end inside the worker; one task runs
        # two parses (gold, prediction) and a comparison, each bounded by it.
        self.inner_timeout_s = max(1, int(timeout_s / 2)) if inner_timeout_s is None else inner_timeout_s
        self.mp_context = mp_context
        self._pool: pebble.ProcessPool | None = None
        self._lock = threading.Lock()

    # -- pool lifecycle
    def _get_pool(self) -> pebble.ProcessPool:
        with self._lock:
            if self._pool is not None and not self._pool.active:
                # Broken since the last batch (e.g. an idle worker was OOM-killed: pebble then fails the
                # whole pool): replace it rather than fail forever. No answer was lost.
                logger.warning("math verification: the worker pool had stopped; starting a new one")
                self._stop_pool()
            if self._pool is None:
                self._pool = pebble.ProcessPool(
                    max_workers=self.num_workers,
                    initializer=worker_init,
                    context=multiprocessing.get_context(self.mp_context),
                )
            return self._pool

    def _stop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def describe(self) -> str:
        """The worker pool's state, for the watchdog's report."""
        pool = self._pool
        state = "not started" if pool is None else ("running" if pool.active else "stopped")
        return f"math-verify pool {state}, {self.num_workers} workers, {self.timeout_s:g} s per answer"

    def close(self) -> None:
        with self._lock:
            self._stop_pool()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- verification
    def verify(self, golds: list[str], completions: list[str]) -> VerifyResult:
        """Rewards of `completions` against `golds` (paired by position). Golds go
        through normalize_gold, so raw dataset answers are fine; against one that has no
        answer (None, "", a box that never closes) every completion scores 0. Never stalls:
        each distinct (gold, prediction) pair is killed after `timeout_s` seconds (and its retry after
        `timeout_s * timeout_retry_factor`). Raises `VerifierUnavailable` when the pool cannot verify
        the batch (see the class)."""
        if len(golds) != len(completions):
            raise ValueError(f"{len(golds)} golds but {len(completions)} completions")
        t0 = time.perf_counter()
        # Keep the end of an over-long completion: that is where the answer is.
        tails = [c[-self.max_completion_chars :] if c else "" for c in completions]
        predictions = [extract_prediction(t) for t in tails]
        others = [
            tuple(other_boxed_answers(t)) if self.multiple_boxed == "wrong" and p is not None else ()
            for t, p in zip(tails, predictions)
        ]
        keys = [
            (g, p, o) if g is not None and p is not None and len(o) <= self.max_other_boxes else None
            for g, p, o in zip(map(gold_or_none, golds), predictions, others)
        ]

        # One task per distinct (gold, prediction): RL groups repeat answers a lot.
        unique = list(dict.fromkeys(k for k in keys if k is not None))
        task = functools.partial(verify_task, strict=self.strict)
        outcome, errored, retried = self._run_with_retry(unique, task) if unique else ({}, set(), set())

        rewards, num_timeouts = [], 0
        for k in keys:
            result = outcome.get(k, False) if k is not None else False
            num_timeouts += result == TIMEOUT
            rewards.append(1.0 if result is True else 0.0)
        return VerifyResult(
            rewards=rewards,
            predictions=predictions,
            num_timeouts=num_timeouts,
            num_no_answer=sum(p is None for p in predictions),
            seconds=time.perf_counter() - t0,
            num_multiple_boxed=sum(bool(o) for o in others),
            # Only counted when something failed: nothing is added to a batch that went well.
            num_errors=sum(k in errored for k in keys) if errored else 0,
            num_timeout_retries=sum(k in retried for k in keys) if retried else 0,
        )

    def parseable_golds(self, golds: list[str]) -> list[bool]:
        """Whether math-verify can parse each gold answer (normalised first; False when it has no answer),
        checked once per distinct gold in the pool, so a pathological gold cannot stall the caller either.
        A gold that still runs out of time on its retry counts as unparseable."""
        normalized = [gold_or_none(g) for g in golds]
        todo = [(g,) for g in dict.fromkeys(normalized) if g is not None and g not in self._gold_ok]
        if todo:
            outcome, _, _ = self._run_with_retry(todo, functools.partial(gold_task, strict=self.strict))
            self._gold_ok.update({g: result is True for (g,), result in outcome.items()})
        return [g is not None and self._gold_ok[g] for g in normalized]

    def _run_with_retry(self, pairs: list[tuple], task) -> tuple[dict[tuple, bool | str], set, set]:
        """`_run`, then once more for the pairs it did not verify: those that ran out of time with the longer
        limits, those whose worker or pool failed on a new pool if the pool failed. Returns the outcome
        {pair: True | False | TIMEOUT | CRASHED}, the pairs that met a failure and the pairs retried for
        time. Raises `VerifierUnavailable` when the pool failed on the retry too, or no pair was verified."""
        outcome, cause = self._run(pairs, task)
        unverified = [p for p, result in outcome.items() if result is not True and result is not False]
        if not unverified:  # the common case: no more work than one pass
            return outcome, set(), set()
        failed = {p for p in unverified if outcome[p] != TIMEOUT}
        slow = {p for p in unverified if outcome[p] == TIMEOUT} if self.timeout_retry_factor else set()
        if failed:
            pool_failed = any(outcome[p] == BROKEN for p in failed)
            logger.warning(
                "math verification: %s; retrying %d of the %d distinct answers%s",
                cause,
                len(failed),
                len(pairs),
                " on a new pool" if pool_failed else "",
            )
            if pool_failed:
                self.close()  # e.g. workers that never answered: start afresh
        if slow:
            logger.info(
                "math verification: %d answers ran out of time; retrying them with %gx the limits",
                len(slow),
                self.timeout_retry_factor,
            )
        retry = [p for p in unverified if p in failed or p in slow]
        if retry:
            again, retry_cause = self._run(retry, task, longer=slow)
            outcome.update(again)
            cause = retry_cause or cause
        unavailable = [p for p in retry if outcome[p] == BROKEN]
        if unavailable or all(outcome[p] == CRASHED for p in pairs):
            raise VerifierUnavailable(self._unavailable_message(cause, len(unavailable) or len(pairs), len(pairs)))
        return outcome, failed, slow

    def _unavailable_message(self, cause: str | None, num_unverified: int, num_pairs: int) -> str:
        """One line: what failed, what it means for the batch and what to do."""
        main_path = getattr(sys.modules.get("__main__"), "__file__", None)
        if main_path and self.mp_context != "fork" and not os.path.isfile(main_path):
            todo = (
                f"Its '{self.mp_context}' workers re-import the main script {main_path}, which no longer "
                "exists: run a script file that stays in place."
            )
        else:
            todo = (
                f"The workers' own error is on stderr above. Its '{self.mp_context}' workers re-import the main "
                "script: it must import without side effects, starting work only under "
                '`if __name__ == "__main__":`; math-verify must import in them; and the machine needs '
                f"memory for {self.num_workers} more processes (model.rewards.verifier.num_workers)."
            )
        return (
            f"math verification cannot run: {cause or 'its worker processes failed'}, on a retry too, so "
            f"{num_unverified} of the {num_pairs} distinct answers of this batch were not verified (rather than scored "
            f"0). {todo}"
        )

    def _run(
        self, pairs: list[tuple], task, longer: set | frozenset = frozenset()
    ) -> tuple[dict[tuple, bool | str], str | None]:
        """Runs `task(*pair, inner timeout)` in the pool, with the hard `timeout_s` and math-verify's own
        `inner_timeout_s`, both `timeout_retry_factor` times longer for the pairs in `longer`. Returns
        {pair: True | False | TIMEOUT | CRASHED | BROKEN} and what failed first (None when nothing did)."""
        factor = self.timeout_retry_factor
        short = (self.timeout_s, self.inner_timeout_s)
        long = (self.timeout_s * factor, math.ceil(self.inner_timeout_s * factor))
        try:
            pool = self._get_pool()
            futures = {}
            for p in pairs:
                hard, inner = long if p in longer else short
                futures[p] = pool.schedule(task, args=(*p, inner), timeout=hard)
        except RuntimeError as e:  # the pool cannot start its workers, or broke since _get_pool checked it
            return dict.fromkeys(pairs, BROKEN), f"the worker pool could not start ({_first_line(e)})"
        # Safety net only, per-task timeouts normally bound the wait: never wait forever,
        # e.g. on workers that cannot start.
        limits = self.timeout_s * (len(pairs) - len(longer)) + long[0] * len(longer)
        deadline = time.monotonic() + 120 + limits / self.num_workers + (long[0] if longer else short[0])
        pending, stuck, stuck_cause = set(futures.values()), BROKEN, None
        while pending:
            _, pending = wait(pending, timeout=1.0)
            if pending and not pool.active:
                # A broken pebble pool fails its running tasks but never its queued ones.
                stuck_cause = "the worker pool stopped"
                break
            if pending and time.monotonic() > deadline:
                stuck_cause = f"no worker answered {len(pending)} tasks by the batch deadline"
                break
        for future in pending:
            future.cancel()
        outcome, cause = {}, None
        for p, f in futures.items():
            result, why = (stuck, stuck_cause) if f in pending else self._result(f)
            outcome[p] = result
            cause = cause or why
        return outcome, cause or stuck_cause

    @staticmethod
    def _result(future) -> tuple[bool | str, str | None]:
        """True/False, or TIMEOUT when the task ran out of time (hard kill or math-verify's own timeout),
        CRASHED when its worker died under it or it could not run, BROKEN when the whole pool failed;
        and what failed, for the log and the error."""
        try:
            result = future.result(timeout=0)
            return (TIMEOUT if result == TIMEOUT else result is True), None
        except TimeoutError:  # pebble's hard kill (concurrent.futures.TimeoutError)
            return TIMEOUT, None
        except BrokenProcessPool as e:
            return BROKEN, f"every worker process stopped ({_first_line(e)})"
        except pebble.ProcessExpired as e:  # the worker crashed (segfault, OOM kill, ...)
            return CRASHED, f"a worker process died under a task (exit code {e.exitcode})"
        except Exception as e:
            return CRASHED, f"a task could not run ({type(e).__name__}: {_first_line(e)})"


def _first_line(error: BaseException) -> str:
    """An error's message up to its first blank line, on one line (spawn explains itself in paragraphs)."""
    paragraph = str(error).strip().split("\n\n")[0]
    return " ".join(paragraph.split())[:300] or type(error).__name__
