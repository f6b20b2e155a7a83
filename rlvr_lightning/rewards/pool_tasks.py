"""What the worker processes of the verifier pool (`rewards.pool`) run: their initializer and their two tasks.

Module-level functions, as pebble pickles a task by its qualified name and each spawned worker imports it
from here; a module apart from the pool's, as none of this runs in the parent.
"""

from __future__ import annotations

import logging

from rlvr_lightning.rewards.verification import TIMEOUT, check_answer, is_timeout, parse_lenient


def verify_task(
    gold: str, prediction: str, others: tuple[str, ...], timeout_s: int | None, *, strict: bool = False
) -> bool | str:
    """Pool task: the prediction, and every other boxed answer of the completion, equal the gold (True), one
    does not (False), or math-verify's own timeout stopped a check before that was known (TIMEOUT).
    Catches everything so that only a hard kill or a crash is an error."""
    try:
        for answer in (prediction, *others):
            outcome = check_answer(gold, answer, timeout_s, strict)
            if outcome is not True:
                return outcome
        return True
    except BaseException:
        return False


def gold_task(gold: str, timeout_s: int | None, *, strict: bool = False) -> bool | str:
    """Pool task: can math-verify parse this gold answer at all? In strict mode it must read it as math,
    not only keep its text: a prediction is compared with the gold's math only, so such a gold could not be met.
    TIMEOUT when math-verify's own timeout stopped it."""
    try:
        parsed = parse_lenient(gold, timeout_s)
        return any(not isinstance(p, str) for p in parsed) if strict else bool(parsed)
    except BaseException as e:
        return TIMEOUT if is_timeout(e) else False


def worker_init() -> None:
    # math-verify logs every input that timed out (up to max_completion_chars) at WARNING.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Import sympy/ANTLR and compile math-verify's regexes now, so that the first task of
    # every (re)started worker does not spend its timeout on them; without a timeout, as a loaded
    # machine may take seconds. A worker in which math-verify cannot run would score every answer
    # 0: it stops instead (its error goes to stderr), and a pool none of whose workers start fails.
    import math_verify  # noqa: F401  (an ImportError here names the missing package)

    if check_answer("1", "1", None, strict=False) is not True:
        raise RuntimeError("math-verify does not verify 1 = 1 in this worker process")
