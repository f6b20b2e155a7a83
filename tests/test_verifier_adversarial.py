"""Verifier hardening: adversarial and fuzzed completions never hang the verifier past its
limit, never execute code or read files, never crash it; conflicting boxed answers score 0 (unless
configured otherwise); gold answers the verifier cannot parse are reported once and skipped."""

from __future__ import annotations

import logging
import random
import time

import pytest

from rlvr_lightning.callbacks.reward import RewardVerifier
from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.rewards.math import MathVerifier, boxed_answers, find_last_boxed, other_boxed_answers

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout_s=TIMEOUT_S) as v:
        yield v


def adversarial_completions(tmp_path) -> dict[str, str]:
    secret = tmp_path / "secret.txt"
    secret.write_text("42")
    marker = tmp_path / "pwned"
    nested = "{" * 5000 + "42" + "}" * 5000
    return {
        "os.system": f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "eval": f"\\boxed{{eval(\"__import__('os').system('touch {marker}')\")}}",
        "exec": f"\\boxed{{exec(\"open('{marker}', 'w')\")}}",
        "read file": f"\\boxed{{open('{secret}').read()}}",  # the file holds the gold: reading it would score
        "sympify payload": "\\boxed{Symbol('x').__class__.__base__.__subclasses__()}",
        "lambda": "\\boxed{(lambda x: x*x)(6)}",  # 36 if it were executed
        "tower exponent": "\\boxed{9^{9^{9^{9}}}}",
        "factorial tower": "\\boxed{(10^{10^{10}})!}",
        "huge power": "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
        "deep braces": "\\boxed{" + nested + "}",
        "deep fractions": "\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "}",
        "unclosed boxes": "\\boxed{" * 20000,
        "100 kB no box": "x + " * 25000,
        "100 kB latex in box": "\\boxed{" + "x^{2} + " * 12500 + "1}",
        "empty": "",
        "only whitespace": " \n\t " * 1000,
        "fullwidth digits": "\\boxed{４２}",
        "rtl override": "\\boxed{\u202e24}",
        "zero width": "\\boxed{4\u200b2}",
        "cyrillic": "\\boxed{42\u0445}",
        "combining marks": "\\boxed{4\u03022\u0302}",
        "nul and controls": "\\boxed{4\x002\x07}",
        "lone surrogate-free emoji": "\\boxed{🔢42}",
        "many different boxes": "".join(f"\\boxed{{{i}}}" for i in range(10000)),
    }


def test_adversarial_completions_are_safe_and_bounded(verifier, tmp_path):
    cases = adversarial_completions(tmp_path)
    t0 = time.perf_counter()
    result = verifier.verify(["42"] * len(cases), list(cases.values()))
    elapsed = time.perf_counter() - t0
    rewards = dict(zip(cases, result.rewards))
    # Liveness, not performance: every task is killed at TIMEOUT_S, so the batch ends within its rounds.
    rounds = len(cases) / verifier.num_workers + 1
    assert elapsed < TIMEOUT_S * rounds + 60
    assert not (tmp_path / "pwned").exists()  # no code ran
    for name in ("os.system", "eval", "exec", "read file", "sympify payload", "tower exponent",
                 "factorial tower", "huge power", "unclosed boxes", "100 kB no box", "100 kB latex in box", "empty",
                 "only whitespace", "rtl override", "cyrillic", "many different boxes"):  # fmt: skip
        assert rewards[name] == 0.0, name
    assert result.num_multiple_boxed >= 1
    assert verifier.verify(["36"], [cases["lambda"]]).rewards == [0.0]  # read as LaTeX, never called
    # The pool survived every one of them (killed workers are replaced).
    assert verifier.verify(["42", "\\frac{1}{2}"], ["\\boxed{42}", "\\boxed{0.5}"]).rewards == [1.0, 1.0]


def test_random_fuzz_never_raises_and_stays_bounded(verifier):
    rng = random.Random(0)
    alphabet = list("0123456789{}\\^_()[]+-*/=., abxyz$#") + ["\\boxed{", "\\frac{", "\\sqrt{", "\\left(", "\\right)",
                                                             "\\infty", "\\pi", "\\text{", "####", "\n"]  # fmt: skip
    completions = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400))) for _ in range(150)]
    t0 = time.perf_counter()
    result = verifier.verify(["7"] * len(completions), completions)
    assert len(result.rewards) == 150 and set(result.rewards) <= {0.0, 1.0}
    assert time.perf_counter() - t0 < TIMEOUT_S * (150 / verifier.num_workers + 1) + 60
    assert verifier.verify(["7"], ["\\boxed{7}"]).rewards == [1.0]


def test_boxed_scanning_is_linear_and_correct():
    found, closed = boxed_answers("a \\boxed{1} b \\boxed{\\frac{1}{2}} c \\boxed{\\boxed{3}}")
    assert [c for _, c in found] == ["1", "\\frac{1}{2}", "\\boxed{3}"] and closed  # nested box belongs to its parent
    assert find_last_boxed("\\boxed{1}" + "\\boxed{" * 50000) is None  # last box never closed: no answer
    assert find_last_boxed("\\boxed{\\{1,2\\}}")[1] == "\\{1,2\\}"


@pytest.mark.parametrize(
    "text, others",
    [
        ("\\boxed{3} so \\boxed{ 3 }", []),  # the same answer twice
        ("\\boxed{3} or maybe \\boxed{4}", ["3"]),
        ("\\boxed{1} \\boxed{2} \\boxed{1} \\boxed{3}", ["1", "2"]),
        ("only \\boxed{\\frac{1}{2}}", []),
        ("\\boxed{\\boxed{3}}", []),  # nested, one top-level answer
        ("no box", []),
    ],
)
def test_other_boxed_answers(text, others):
    assert other_boxed_answers(text) == others


def test_every_boxed_answer_must_be_right_unless_configured(verifier):
    texts = ["\\boxed{5} or \\boxed{6}", "\\boxed{6} or \\boxed{5}", "\\boxed{6} and again \\boxed{6}",
             "\\boxed{\\frac{12}{2}}, that is \\boxed{6}", "".join(f"\\boxed{{{i}}}" for i in range(7)) + "\\boxed{6}"]  # fmt: skip
    result = verifier.verify(["6"] * len(texts), texts)
    # Equivalent forms of one value are one answer (MATH solutions box 15\\frac{39}{40} and \\frac{639}{40}).
    assert result.rewards == [0.0, 0.0, 1.0, 1.0, 0.0] and result.num_multiple_boxed == 4
    with MathVerifier(num_workers=1, multiple_boxed="last") as last:
        assert last.verify(["6"] * len(texts), texts).rewards == [1.0, 0.0, 1.0, 1.0, 1.0]  # the last box is graded
    with pytest.raises(ValueError, match="multiple_boxed"):
        MathVerifier(multiple_boxed="first")


def test_unparseable_golds_are_reported_once_and_skipped(caplog):
    records = [ProblemRecord("a", "1+1?", "2"), ProblemRecord("b", "bad", "\\text{ }"), ProblemRecord("c", "x", "$$"),
               ProblemRecord("d", "2+2?", "4")]  # fmt: skip
    callback = RewardVerifier(num_workers=1)
    try:
        with caplog.at_level(logging.WARNING):
            kept = callback.drop_unparseable_golds(records, "data.train_data")
        assert [r.id for r in kept] == ["a", "d"]
        warnings = [r.getMessage() for r in caplog.records if "cannot parse" in r.getMessage()]
        assert len(warnings) == 1 and "skipped 2 of 4" in warnings[0] and "b:" in warnings[0]
    finally:
        callback.teardown(None, None, "fit")
