"""Hardened math answer verifier: the reward of RL training and the metric of evaluation.

A completion's answer is extracted in the parent with plain string operations (last
``\\boxed{...}``, else GSM8K's ``#### N``) and compared with the gold answer by
math-verify (sympy) in a persistent pool of worker processes.

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

No model output is ever eval'ed or exec'ed here: extraction is string slicing, and
math-verify parses LaTeX with an ANTLR grammar; its plain-expression path only ever hands
sympy strings of digits, operators and spaces (see its ``ExprExtractionConfig`` regex).

Strict mode (``MathVerifier(strict=True)``, see `_parse_strict`) closes a reward-hacking surface of
math-verify's leniency: when a box does not parse, ``parse()`` goes on to read any number or LaTeX
fragment it finds inside it, so ``\\boxed{(lambda: 42)()}`` scores as 42. Strict mode reads the whole
answer as LaTeX or gives no reward: code (``lambda``, ``__import__``, calls such as ``print(42)``) and
hedging in words are never read whole as the gold's value. Mathematics that math-verify's grammar has
no token for is read, in golds and predictions and in both modes (`_parse`, `_fill_grammar_gaps`): a
subscripted E or e (``E_{1}, E_{2}``) and a number whose point ends it (``-1./3``), which math-verify
alone keeps only as text, or reads in part (the -1/2 of ``-\\frac{1}{2} E_{0}``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import multiprocessing
import numbers
import os
import re
import sys
import threading
import time
from concurrent.futures import wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import pebble

logger = logging.getLogger(__name__)

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A comma between digit groups of three ("1,450,000"), but not in tuples like "(1,2)".
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_INTEGER = re.compile(r"[+-]?\d+")
# A whole gold written in math delimiters, "$2$" (OlympiadBench); "\$36" (an escaped dollar) is not one.
_IN_DOLLARS = re.compile(r"\$+([^$]*)\$+")
# Two spellings of mathematics that math-verify's LaTeX grammar cannot read (see `_fill_grammar_gaps`),
# found in one pass; a \text{...} span is matched whole first, so nothing inside one changes.
_GRAMMAR_GAPS = re.compile(
    r"(?P<text>\\text\s*\{[^{}]*\})"
    # A lone E or e (not the end of a command or a word) with a subscript: the grammar lexes it as Euler's
    # number, a token that takes no subscript, so "E_{1}" and "e_x" are syntax errors.
    r"|(?<![\\A-Za-z])(?P<e>[Ee])(?=\s*_)"
    # A number whose decimal point ends it ("-1./3", "2."): the grammar's numbers need a digit after the
    # point. Only where an operator, a separator, a closing bracket or the end follows, never a digit, a
    # letter or a command: "1.e-3" would read as 1*e - 3 (e is Euler's number), "0.\overline{3}" is a
    # repeating decimal.
    r"|(?<![\d.])(?P<integer>\d+)\.(?=\s*(?:[-+*/,;:=<>|&)\]}]|\\(?:times|cdot|div|\\)(?![A-Za-z])|$))"
)


# --------------------------------------------------------------------------- extraction
def boxed_answers(text: str) -> tuple[list[tuple[int, str]], tuple[int, str] | None]:
    """Every top-level ``\\boxed{...}`` / ``\\fbox{...}`` of `text` as (offset, stripped content), in order,
    and the last box opened as (offset, stripped content), or None when it is never closed.

    One linear pass with a stack (not one scan per box): a policy can emit thousands of nested or
    unclosed boxes, and a per-box scan would be quadratic in the completion length. Escaped braces
    (``\\{``, ``\\}``, e.g. ``\\left\\{``) are not grouping braces. Boxes inside a box are part of its
    content, not answers of their own; the last box opened may be such an inner one
    (``\\boxed{\\boxed{3}}`` answers 3).
    """
    opens = {m.end(): m.start() for m in _BOX_RE.finditer(text)}  # content start -> offset of the box
    if not opens:
        return [], None
    last_open = max(opens)
    found, stack, open_boxes, last = [], [], 0, None
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            box = (i + 1) in opens
            stack.append(i + 1 if box else -1)
            open_boxes += box
        elif ch == "}" and stack:
            start = stack.pop()
            if start >= 0:
                open_boxes -= 1
                content = text[start:i].strip()
                if start == last_open:
                    last = (opens[start], content)
                if open_boxes == 0:  # top level
                    found.append((opens[start], content))
        i += 1
    return found, last


def find_last_boxed(text: str) -> tuple[int, str] | None:
    """(offset of the last ``\\boxed{`` / ``\\fbox{``, its content), braces balanced.

    None when there is no box, when the last box is never closed (a truncated
    generation has no answer), or when it is empty.
    """
    if not text:
        return None
    _, last = boxed_answers(text)
    return last if last is not None and last[1] else None


def other_boxed_answers(text: str) -> list[str]:
    """The distinct boxed answers of `text` other than its last one (whitespace ignored), in order.

    Under `MathVerifier(multiple_boxed="wrong")` each of them must also equal the gold answer, so a
    completion cannot game a last-box reward by boxing several candidates, while a solution that
    boxes one value in two forms (MATH writes both ``15\\frac{39}{40}`` and ``\\frac{639}{40}``) still counts.
    """
    found, _ = boxed_answers(text) if text else ([], None)
    if len(found) < 2:
        return []
    last = "".join(found[-1][1].split())
    others = dict.fromkeys("".join(c.split()) for _, c in found[:-1])
    return [o for o in others if o and o != last]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (see `find_last_boxed`)."""
    found = find_last_boxed(text)
    return None if found is None else found[1]


def _after_hashes(text: str) -> str | None:
    """GSM8K style: first line of the text after the last '####', stripped."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    answer = tail.splitlines()[0].strip() if tail else ""
    return answer or None


def extract_prediction(completion: str) -> str | None:
    """The answer a completion commits to: last box, else '#### N', else None."""
    if not completion:
        return None
    boxed = extract_boxed(completion)
    return boxed if boxed is not None else _after_hashes(completion)


def normalize_gold(answer) -> str:
    """Turn a stored gold answer into the final-answer string the verifier compares against.

    - numbers: integral values lose the ".0" (AMC23 stores 27.0 -> "27"), other floats use str();
    - GSM8K style "... #### 1,234": the text after the last "####", thousands commas removed (only
      there: in MATH answers a comma separates list items, "1,-2");
    - a full solution containing \\boxed{...} (MATH `solution`): the content of its answer box, found
      by the scanner that reads completions (`boxed_answers`: balanced and escaped braces, \\fbox too):
      the last box opened or, when that one is cut off, the last balanced box before it (a stored
      solution still has its answer, unlike a truncated completion);
    - a list (OlympiadBench's `final_answer`): one item is that answer; several are an unordered set
      of answers, joined as "a, b" (see `_gold_list`);
    - a string wholly in math delimiters ("$2$") loses them;
    - otherwise the stripped string.
    Plain integers are written canonically ("025" -> "25"): AIME stores 3-digit zero-padded answers
    and a string comparison would otherwise reject a correct "25".
    Raises ValueError, with a message starting "gold answer", when there is no answer to compare
    against: None, a boolean, NaN or infinity, another type, nothing left after normalisation, or
    boxes none of which close.
    """
    if answer is None:
        raise ValueError("gold answer is empty (null)")
    if isinstance(answer, bool):  # bool is an int subclass; True as a gold answer is a data bug
        raise ValueError(f"gold answer is a boolean ({answer}), expected text or a number")
    if isinstance(answer, numbers.Integral):  # also numpy ints
        return str(int(answer))
    if isinstance(answer, numbers.Real):  # floats, numpy floats
        value = float(answer)
        if not math.isfinite(value):  # NaN is how parquet/pandas store a missing number
            raise ValueError(f"gold answer is not a finite number ({value})")
        return str(int(value)) if value.is_integer() else str(value)
    if isinstance(answer, (list, tuple)):
        return _gold_list(answer)
    if not isinstance(answer, str):
        raise ValueError(f"gold answer has type {type(answer).__name__}, expected text, a number or a list")

    text = answer.strip()
    dollars = _IN_DOLLARS.fullmatch(text)
    if dollars:
        text = dollars[1].strip()
    if "####" in text:
        text = _THOUSANDS_COMMA.sub("", text.rsplit("####", 1)[1]).strip()
    elif _BOX_RE.search(text):
        found, last = boxed_answers(text)
        if last is None and not found:
            raise ValueError("gold answer has a \\boxed{ with unbalanced braces")
        _, text = last if last is not None else found[-1]
    if _INTEGER.fullmatch(text):
        text = str(int(text))
    if not text:
        raise ValueError("gold answer is empty")
    return text


def _gold_list(answers: list | tuple) -> str:
    """A list of gold answers as one gold string: its items normalised, duplicates dropped, joined by ", ".

    math-verify parses a top-level comma list as a FiniteSet and compares sets regardless of order
    (``sympy_compare_sets``), so the completion must give the same set: both answers, in any order;
    one of two scores 0. Not ``\\{a, b\\}``: math-verify cannot parse ``\\{\\text{a}, \\text{b}\\}``.
    And not a list of golds: ``verify()`` accepts a prediction equal to any one of its golds.
    An item that itself has a top-level comma ("x=1, y=2") is not kept apart from the others.
    """
    if not answers:
        raise ValueError("gold answer is an empty list")
    if any(isinstance(a, (list, tuple)) for a in answers):
        raise ValueError("gold answer is a nested list")
    return ", ".join(dict.fromkeys(normalize_gold(a) for a in answers))


def _gold_or_none(answer) -> str | None:
    """`normalize_gold`, or None for a gold answer that has no answer (every completion scores 0)."""
    try:
        return normalize_gold(answer)
    except ValueError:
        return None


# -------------------------------------------------------------------------- verification
def _parse(text: str, timeout_s: int | None) -> list:
    from math_verify import parse

    # The whole text read as strict mode reads a prediction comes first. Where math-verify's grammar cannot
    # read all of it, parse() reads a part: the -1/2 of "-\frac{1}{2} E_{0}" (it has no token for a
    # subscripted E, see `_fill_grammar_gaps`), and a gold read so would reward that part; "E_{1}, E_{2}" it
    # keeps only as text, which a strict prediction, always math, could never meet.
    try:
        whole = _parse_strict(text, timeout_s)
    except Exception:  # not LaTeX as a whole; a timeout (a BaseException) propagates, as below
        whole = []
    # A bare answer ("\frac{1}{2}", "(3,4]", "18") is not found by math-verify's extractors
    # unless it sits in a box or in math delimiters. The box comes first because its
    # extraction takes the whole content (a "$...$" match may pick a sub-expression).
    # raise_on_error: a timeout raises instead of returning [], so a slow input is not
    # parsed a second time under the other wrapping.
    for wrapped in (f"\\boxed{{{text}}}", f"${text}$"):
        parsed = parse(wrapped, parsing_timeout=timeout_s, raise_on_error=True)
        if parsed:
            break
    # With the whole reading, parse()'s string of the text stays: lenient mode compares it with a
    # prediction that is only text, as before.
    return [*whole, *(p for p in parsed if isinstance(p, str))] if whole else parsed


def _fill_grammar_gaps(latex: str) -> str:
    """Normalised LaTeX with two spellings math-verify's grammar cannot read rewritten into ones it reads as
    the same mathematics: a subscripted E or e becomes ``\\text{E}_...``, the symbol math-verify also makes
    of ``\\mathrm{E}_1`` ("E_{1}, E_{2}" is the set {e_1, e_2}), and a point that ends a number is dropped
    ("-1./3" is -1/3).

    Applied to normalised text only (before normalisation, ``\\text{E}`` would be taken for a unit and
    removed: "2\\text{E}_1" would read as 2), and only to text the grammar has already failed to read
    (`_parse_strict`), so no answer it reads changes meaning: the grammar also reads the content of
    ``\\vec{E_1}`` and other accents as a symbol name.
    """

    def fill(m: re.Match) -> str:
        if m["e"]:
            return f"\\text{{{m['e']}}}"
        return m["integer"] or m[0]  # a \text{...} span is kept as it is

    return _GRAMMAR_GAPS.sub(fill, latex)


def _parse_strict(text: str, timeout_s: int | None) -> list:
    """`text` read whole as LaTeX, or an exception: the strict reading of a completion's answer.

    This is the path math-verify's ``parse()`` takes for a box (``extract_latex`` on its boxed match):
    its normalisation (units, a trailing ``\\text{...}``, ``\\left``/``\\right``, ``\\dfrac``, ``$``,
    quotes, ...), then the ANTLR grammar, whose error listener raises on the first token it cannot
    read; where it does, once more with `_fill_grammar_gaps` (a subscripted E, a number ending in a point).
    What strict mode leaves out are ``parse()``'s fallbacks, each of which reads a part of the
    text and skips the rest: the other extraction patterns tried when the box does not parse (any
    plain number, ``$...$`` span, ``\\frac{a}{b}`` or "final answer is ..." inside it), the retry on
    the part after the last "=" (``get_last_eq``), the unparsed string itself as an answer (compared
    by string equality), and `_parse`'s second try with the text in ``$...$``. The text is not put in
    a box either: math-verify's box scanner counts escaped braces, so it could cut ``42\\} junk`` short.
    So code is rejected because it is not LaTeX as a whole (``(lambda: 42)()`` is a syntax error), or
    because what the grammar makes of it is not the gold's value (``print(42)`` reads as a product of
    the symbols p, r, i, n and a function t applied to 42), not by a list of forbidden words, which
    would also have to tell ``\\lambda`` from ``lambda``.
    """
    from dataclasses import replace

    from latex2sympy2_extended import latex2sympy, normalize_latex
    from math_verify import LatexExtractionConfig
    from math_verify.grader import should_treat_as_complex
    from math_verify.utils import timeout

    config = replace(LatexExtractionConfig().normalization_config, boxed="none")

    def to_sympy(latex: str):
        return latex2sympy(latex, is_real=not should_treat_as_complex(latex), normalization_config=None)

    @timeout(timeout_seconds=timeout_s)
    def read() -> list:
        latex = normalize_latex(text.strip(), config)
        try:
            return [to_sympy(latex)]
        except Exception:
            filled = _fill_grammar_gaps(latex)
            if filled == latex:
                raise
            return [to_sympy(filled)]

    return read()


def verify_answer(gold: str, prediction: str | None, *, timeout_s: int | None = 2, strict: bool = False) -> bool:
    """True iff `prediction` is mathematically equivalent to `gold` (math-verify).

    `strict`: the prediction must be read whole as LaTeX (`_parse_strict`); the gold, which is
    data and not model output, is always read leniently (`_parse`: whole if it can be, else as
    math-verify's ``parse()`` reads it).
    `timeout_s` is math-verify's own SIGALRM timeout per parse / comparison (whole
    seconds; None or 0 disables it). Meant to run in a pool worker's main thread; called
    from another thread it runs without those timeouts, as SIGALRM cannot be used there.
    Never raises: any failure, including math-verify's timeout, gives False.
    """
    return _check_answer(gold, prediction, timeout_s, strict) is True


# What a check gives when math-verify's own timeout stopped it: not a wrong answer, it is retried
# with a longer limit (`MathVerifier.timeout_retry_factor`).
TIMEOUT = "timeout"


def _check_answer(gold: str, prediction: str | None, timeout_s: int | None, strict: bool) -> bool | str:
    """`verify_answer`, but TIMEOUT instead of False when math-verify's own timeout stopped a parse or every
    comparison that did not fail otherwise. Never raises (but KeyboardInterrupt, SystemExit)."""
    if not gold or not prediction:
        return False
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    timeout_s = int(timeout_s) if timeout_s else None  # signal.alarm takes whole seconds
    try:
        from math_verify import verify
        from math_verify.errors import TimeoutException

        gold_parsed = _parse(gold, timeout_s)  # gold first: verify() is not symmetric
        if not gold_parsed:
            return False
        pred_parsed = (_parse_strict if strict else _parse)(prediction, timeout_s)
        if not pred_parsed:
            return False
        # verify() compares every (gold, prediction) reading and is True if one matches; it turns a timeout
        # into False, so the readings are compared one pair at a time here, as it would, to tell the two apart.
        timed_out = False
        for g, p in itertools.product(gold_parsed, pred_parsed):
            try:
                if verify([g], [p], timeout_seconds=timeout_s, raise_on_error=True):
                    return True
            except TimeoutException:
                timed_out = True
            except Exception:  # what verify() scores False
                pass
        return TIMEOUT if timed_out else False
    except (KeyboardInterrupt, SystemExit):
        raise  # only ever seen when called in the parent; workers ignore SIGINT
    except BaseException as e:  # math-verify's TimeoutException is a BaseException
        return TIMEOUT if _is_timeout(e) else False


def _is_timeout(error: BaseException) -> bool:
    """Whether `error` is math-verify's own timeout (imported here: the parent never loads math-verify)."""
    try:
        from math_verify.errors import TimeoutException
    except ImportError:  # then the worker cannot start (`_worker_init`)
        return False
    return isinstance(error, TimeoutException)


def _verify_task(
    gold: str, prediction: str, others: tuple[str, ...], timeout_s: int | None, *, strict: bool = False
) -> bool | str:
    """Pool task: the prediction, and every other boxed answer of the completion, equal the gold (True), one
    does not (False), or math-verify's own timeout stopped a check before that was known (TIMEOUT).
    Catches everything so that only a hard kill or a crash is an error."""
    try:
        for answer in (prediction, *others):
            outcome = _check_answer(gold, answer, timeout_s, strict)
            if outcome is not True:
                return outcome
        return True
    except BaseException:
        return False


def _gold_task(gold: str, timeout_s: int | None, *, strict: bool = False) -> bool | str:
    """Pool task: can math-verify parse this gold answer at all? In strict mode it must read it as math,
    not only keep its text: a prediction is compared with the gold's math only, so such a gold could not be met.
    TIMEOUT when math-verify's own timeout stopped it."""
    try:
        parsed = _parse(gold, timeout_s)
        return any(not isinstance(p, str) for p in parsed) if strict else bool(parsed)
    except BaseException as e:
        return TIMEOUT if _is_timeout(e) else False


def _worker_init() -> None:
    # math-verify logs every input that timed out (up to max_completion_chars) at WARNING.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Import sympy/ANTLR and compile math-verify's regexes now, so that the first task of
    # every (re)started worker does not spend its timeout on them; without a timeout, as a loaded
    # machine may take seconds. A worker in which math-verify cannot run would score every answer
    # 0: it stops instead (its error goes to stderr), and a pool none of whose workers start fails.
    import math_verify  # noqa: F401  (an ImportError here names the missing package)

    if _check_answer("1", "1", None, strict=False) is not True:
        raise RuntimeError("math-verify does not verify 1 = 1 in this worker process")


# -------------------------------------------------------------------------------- public
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
    `strict`: an answer counts only if math-verify reads it whole as LaTeX (`_parse_strict`), not by
    picking a number or fragment out of text it cannot parse. On by default: every reference answer
    of MATH-500, AIME24, AMC23 and GSM8K still verifies in it (tests/rewards/test_math.py).
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
        self.inner_timeout_s = (
            max(1, int(timeout_s / 2)) if inner_timeout_s is None else inner_timeout_s
        )
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
                    initializer=_worker_init,
                    context=multiprocessing.get_context(self.mp_context),
                )
            return self._pool

    def _stop_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

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
            for g, p, o in zip(map(_gold_or_none, golds), predictions, others)
        ]

        # One task per distinct (gold, prediction): RL groups repeat answers a lot.
        unique = list(dict.fromkeys(k for k in keys if k is not None))
        task = functools.partial(_verify_task, strict=self.strict)
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
        normalized = [_gold_or_none(g) for g in golds]
        todo = [(g,) for g in dict.fromkeys(normalized) if g is not None and g not in self._gold_ok]
        if todo:
            outcome, _, _ = self._run_with_retry(todo, functools.partial(_gold_task, strict=self.strict))
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
                cause, len(failed), len(pairs), " on a new pool" if pool_failed else "",
            )  # fmt: skip
            if pool_failed:
                self.close()  # e.g. workers that never answered: start afresh
        if slow:
            logger.info("math verification: %d answers ran out of time; retrying them with %gx the limits",
                        len(slow), self.timeout_retry_factor)  # fmt: skip
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
            todo = (f"Its '{self.mp_context}' workers re-import the main script {main_path}, which no longer "
                    "exists: run a script file that stays in place.")  # fmt: skip
        else:
            todo = (f"The workers' own error is on stderr above. Its '{self.mp_context}' workers re-import the main "
                    "script: it must import without side effects, starting work only under "
                    "`if __name__ == \"__main__\":`; math-verify must import in them; and the machine needs "
                    f"memory for {self.num_workers} more processes (RewardVerifier.num_workers).")  # fmt: skip
        return (f"math verification cannot run: {cause or 'its worker processes failed'}, on a retry too, so "
                f"{num_unverified} of the {num_pairs} distinct answers of this batch were not verified (rather than scored "
                f"0). {todo}")  # fmt: skip

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
