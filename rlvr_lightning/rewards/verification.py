"""Whether one prediction equals its gold answer, by math-verify (sympy): the lenient and the strict reading.

Called in-process (`verify_answer`) or, for training and evaluation, as a task of the worker pool
(`rewards.pool_tasks`, `rewards.pool`), which bounds each check with a hard kill; math-verify's own
timeouts, used here too, stop most slow cases first.

No model output is ever eval'ed or exec'ed here: math-verify parses LaTeX with an ANTLR grammar; its
plain-expression path only ever hands sympy strings of digits, operators and spaces (see its
``ExprExtractionConfig`` regex).

Strict mode (``MathVerifier(strict=True)``, see `_parse_strict`) closes a reward-hacking surface of
math-verify's leniency: when a box does not parse, ``parse()`` goes on to read any number or LaTeX
fragment it finds inside it, so ``\\boxed{(lambda: 42)()}`` scores as 42. Strict mode reads the whole
answer as LaTeX or gives no reward: code (``lambda``, ``__import__``, calls such as ``print(42)``) and
hedging in words are never read whole as the gold's value. Mathematics that math-verify's grammar has
no token for is read, in golds and predictions and in both modes (`parse_lenient`, `_fill_grammar_gaps`): a
subscripted E or e (``E_{1}, E_{2}``) and a number whose point ends it (``-1./3``), which math-verify
alone keeps only as text, or reads in part (the -1/2 of ``-\\frac{1}{2} E_{0}``).
"""

from __future__ import annotations

import itertools
import re
import threading

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


def parse_lenient(text: str, timeout_s: int | None) -> list:
    """The lenient reading of `text`, a gold's always: whole if it can be, else as math-verify's ``parse()`` reads it."""
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
    by string equality), and `parse_lenient`'s second try with the text in ``$...$``. The text is not put in
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
    data and not model output, is always read leniently (`parse_lenient`: whole if it can be, else as
    math-verify's ``parse()`` reads it).
    `timeout_s` is math-verify's own SIGALRM timeout per parse / comparison (whole
    seconds; None or 0 disables it). Meant to run in a pool worker's main thread; called
    from another thread it runs without those timeouts, as SIGALRM cannot be used there.
    Never raises: any failure, including math-verify's timeout, gives False.
    """
    return check_answer(gold, prediction, timeout_s, strict) is True


# What a check gives when math-verify's own timeout stopped it: not a wrong answer, it is retried
# with a longer limit (`MathVerifier.timeout_retry_factor`).
TIMEOUT = "timeout"


def check_answer(gold: str, prediction: str | None, timeout_s: int | None, strict: bool) -> bool | str:
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

        gold_parsed = parse_lenient(gold, timeout_s)  # gold first: verify() is not symmetric
        if not gold_parsed:
            return False
        pred_parsed = (_parse_strict if strict else parse_lenient)(prediction, timeout_s)
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
        return TIMEOUT if is_timeout(e) else False


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is math-verify's own timeout (imported here: the parent never loads math-verify)."""
    try:
        from math_verify.errors import TimeoutException
    except ImportError:  # then the worker cannot start (`worker_init`)
        return False
    return isinstance(error, TimeoutException)
