"""Reading the answer out of a completion or a stored gold answer, with plain string operations only.

A completion's answer is extracted in the parent process (last ``\\boxed{...}``, else GSM8K's ``#### N``),
and a dataset's gold answer normalised to the final-answer string the verifier compares against
(`normalize_gold`). Nothing here parses mathematics: that is `rewards.verification`, in the worker pool
(`rewards.pool`). No model output is ever eval'ed or exec'ed: extraction is string slicing.
"""

from __future__ import annotations

import math
import numbers
import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A comma between digit groups of three ("1,450,000"), but not in tuples like "(1,2)".
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_INTEGER = re.compile(r"[+-]?\d+")
# A whole gold written in math delimiters, "$2$" (OlympiadBench); "\$36" (an escaped dollar) is not one.
_IN_DOLLARS = re.compile(r"\$+([^$]*)\$+")


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


def gold_or_none(answer) -> str | None:
    """`normalize_gold`, or None for a gold answer that has no answer (every completion scores 0)."""
    try:
        return normalize_gold(answer)
    except ValueError:
        return None
