"""Verifier hardening: adversarial and fuzzed completions never hang the verifier past its
limit, never execute code or read files, never crash it; conflicting boxed answers score 0 (unless
configured otherwise); gold answers the verifier cannot parse are reported once and skipped; in
strict mode an answer counts only when math-verify reads the whole of it, not a part it picked out."""

from __future__ import annotations

import logging
import random
import time

import pytest
import torch

from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.rewards.extraction import boxed_answers, extract_prediction, find_last_boxed, other_boxed_answers
from rlvr_lightning.rewards.pool import MathVerifier
from rlvr_lightning.rewards.settings import RewardSettings, VerifierSettings
from rlvr_lightning.rewards.verification import verify_answer
from rlvr_lightning.training.scoring import Scoring

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
    # Liveness, not performance: every task is killed at TIMEOUT_S, and its one retry at TIMEOUT_S times
    # timeout_retry_factor, so the batch ends within its rounds.
    rounds = len(cases) / verifier.num_workers + 1
    assert elapsed < TIMEOUT_S * (1 + verifier.timeout_retry_factor) * rounds + 60
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
    assert time.perf_counter() - t0 < TIMEOUT_S * (1 + verifier.timeout_retry_factor) * (150 / verifier.num_workers + 1) + 60
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
    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1)))
    try:
        with caplog.at_level(logging.WARNING):
            kept = scoring.drop_unparseable_golds(records, "data.train_data")
            assert scoring.drop_unparseable_golds(records, "data.train_data") == kept  # reported once
        assert [r.id for r in kept] == ["a", "d"]
        warnings = [r.getMessage() for r in caplog.records if "cannot parse" in r.getMessage()]
        assert len(warnings) == 1 and "skipped 2 of 4" in warnings[0] and "b:" in warnings[0]
    finally:
        scoring.close()


# ------------------------------------------------------------------------------ strict mode
# (gold, completion) pairs where the completion gives the gold in a form math-verify reads whole.
STRICT_ACCEPTS = [
    ("\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}"), ("\\frac{1}{2}", "\\boxed{\\tfrac12}"), ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("-\\frac{3}{4}", "\\boxed{-\\dfrac{3}{4}}"), ("-7", "\\boxed{-7}"), ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"),
    ("\\sqrt[3]{2}", "\\boxed{2^{1/3}}"), ("[1, 2)", "\\boxed{[1,2)}"), ("(-\\infty, 3]", "\\boxed{\\left(-\\infty, 3\\right]}"),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}"), ("5", "\\boxed{5\\text{ cm}}"), ("5", "\\boxed{5 \\text{cm}^2}"),
    ("5", "\\boxed{5\\,\\mathrm{cm}}"), ("5", "\\boxed{5 \\text{ inches}}"), ("30", "\\boxed{30^\\circ}"),
    ("30^\\circ", "\\boxed{30^{\\circ}}"), ("25\\%", "\\boxed{25\\%}"), ("\\$18.90", "\\boxed{\\$18.90}"),
    ("1234", "#### 1,234"), ("x = 3", "\\boxed{x=3}"), ("2", "\\boxed{x = \\frac{4}{2} = 2}"), ("3+2i", "\\boxed{2i + 3}"),
    ("\\text{(C)}", "\\boxed{\\text{(C)}}"), ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}"),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\boxed{\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}}"),
    ("42", "\\boxed{\\displaystyle 42}"),
]  # fmt: skip
# (gold, completion) pairs that lenient math-verify scores correct only by reading a part of the answer.
STRICT_REJECTS = [
    ("42", "\\boxed{(lambda: 42)()}"),  # Python: the box does not parse, a plain number inside it does
    ("42", "\\boxed{(lambda: 0)() or 42}"),
    ("42", "\\boxed{def f(): return 42}"),
    ("42", "\\boxed{return 42;}"),
    ("42", "\\boxed{41 or 42 (not sure) ???}"),  # hedging in stray words: the last number is read
    ("42", "\\boxed{maybe 41?? no: 42}"),
    ("42", "\\boxed{@@ 42}"),
    ("42", "\\boxed{final answer is $42$ I hope}"),  # a phrase math-verify looks for before the box
    ("42", "\\boxed{y = (lambda: 0)() = 42}"),  # retried on what follows the last "="
    ("42", "#### 42} junk {"),  # math-verify's box scanner would stop at the first "}"
    ("\\frac{1}{2}", "\\boxed{hmm \\frac{1}{2} ???}"),  # a \\frac{a}{b} fragment
    ("\\frac{1}{2}", "\\boxed{[\\frac{1}{2}]??}"),
]


@pytest.fixture(scope="module")
def strict_verifier():
    with MathVerifier(num_workers=2, timeout_s=10.0, strict=True) as v:  # generous: a slow CI machine is no rejection
        yield v


def test_strict_mode_accepts_well_formed_answers(strict_verifier):
    golds, completions = map(list, zip(*STRICT_ACCEPTS))
    rewards = strict_verifier.verify(golds, completions).rewards
    assert [c for c, r in zip(completions, rewards) if r != 1.0] == []


def test_strict_mode_rejects_answers_read_by_skipping_text(strict_verifier):
    # Each is a real leniency: math-verify itself (lenient mode, in-process) scores it correct.
    lenient = [verify_answer(g, extract_prediction(c), timeout_s=None) for g, c in STRICT_REJECTS]
    assert [c for (_, c), ok in zip(STRICT_REJECTS, lenient) if not ok] == []
    golds, completions = map(list, zip(*STRICT_REJECTS))
    rewards = strict_verifier.verify(golds, completions).rewards
    assert [c for c, r in zip(completions, rewards) if r != 0.0] == []
    # A rejected box among several answers fails the completion too (multiple_boxed="wrong").
    assert strict_verifier.verify(["42"], ["\\boxed{(lambda: 42)()} so \\boxed{42}"]).rewards == [0.0]


def test_strict_mode_drops_golds_it_could_never_match(strict_verifier):
    # math-verify keeps "\\{\\text{a}\\}" only as text, which lenient mode compares by string equality.
    golds = ["\\{\\text{a}\\}", "2"]
    assert strict_verifier.parseable_golds(golds) == [False, True]
    with MathVerifier(num_workers=1, strict=False) as lenient:
        assert lenient.parseable_golds(golds) == [True, True]


# Physics and chemistry answers, as (gold, completions that equal it, completions that do not). A subscripted
# E or e and a number ending in a point have no token in math-verify's grammar; they are read as math on both
# sides, so an equivalent form counts too (math-verify alone compares them as text only).
STRICT_MATH_FORMS = [
    ("\\frac{dM}{dt}=-kM", ["\\frac{dM}{dt}=-kM", "\\frac{d M}{d t} = -k M"],
     ["\\frac{dM}{dt}=-kM+1", "\\frac{dM}{dt}=-M", "\\frac{d^2M}{dt^2}=-kM"]),
    ("\\frac{\\hbar^2}{2m}", ["\\frac{\\hbar^2}{2m}", "\\frac{\\hbar^{2}}{2 m}"],
     ["\\frac{\\hbar^2}{m}", "\\frac{\\hbar}{2m}"]),
    ("E_{1},E_{2}", ["E_{1},E_{2}", "E_2, E_1"], ["E_{1},E_{3}", "E_{1}", "E_{1},E_{2},E_{3}"]),
    ("-1./3", ["-1./3", "-\\frac{1}{3}"], ["-1./4", "1./3", "-1"]),
    ("E_n=\\frac{n^2\\pi^2\\hbar^2}{2mL^2}", ["E_n=\\frac{n^2\\pi^2\\hbar^2}{2mL^2}", "E_{n} = \\frac{\\pi^2 \\hbar^2 n^2}{2 m L^2}"],
     ["E_n=\\frac{n\\pi^2\\hbar^2}{2mL^2}", "E_n=\\frac{n^2\\pi^2\\hbar}{2mL^2}"]),
    # math-verify alone reads the gold as its part -1/2, which would reward that part.
    ("-\\frac{1}{2} E_{0}", ["-\\frac{1}{2} E_{0}", "-\\frac{E_0}{2}"], ["-\\frac{1}{2}", "\\frac{1}{2} E_{0}"]),
    ("3E_1", ["3 E_{1}"], ["3"]),  # filled in before normalisation, \text{E}_1 would be dropped as a unit
    ("\\vec{E_1}", ["\\vec{E_1}"], ["\\vec{E_2}"]),  # an accent's content is read as it was
    ("1.e-3", [], ["e-3"]),  # a point before a letter stays: "1e-3" would read as 1*e - 3
]  # fmt: skip


def test_strict_mode_reads_physics_notation_as_math(strict_verifier):
    golds, completions, expected = [], [], []
    for gold, right, wrong in STRICT_MATH_FORMS:
        for answers, reward in ((right, 1.0), (wrong, 0.0)):
            golds += [gold] * len(answers)
            completions += [f"so \\boxed{{{a}}}" for a in answers]
            expected += [reward] * len(answers)
    rewards = strict_verifier.verify(golds, completions).rewards
    assert [(g, c, r) for g, c, r, e in zip(golds, completions, rewards, expected) if r != e] == []
    # Such golds are kept when the training data is filtered; one math-verify cannot read stays out.
    assert strict_verifier.parseable_golds(["E_{1}, E_{2}", "-1./3", "\\{\\text{a}\\}"]) == [True, True, False]


# Code (most of it worth 42 if it were run) scores 0 against the gold 42.
CODE_PAYLOADS = [
    "(lambda: 42)()", "__import__('os').system('x')", "print(42)", "sum([40,2])", "int('42')", "eval('6*7')",
    "max(42, 0)", "`42`", "42 # the answer", "x := 42", "return 42;", "def f(): return 42", "/* x */ 42",
    "console.log(42)", "[42][0]", "42 if True else 0", "np.int64(42)",
    "E_{(lambda: 42)()}", "int(42.)", "42.real",  # code around the two spellings strict mode fills in
]  # fmt: skip


def test_strict_mode_rejects_code(strict_verifier):
    completions = [f"\\boxed{{{c}}}" for c in CODE_PAYLOADS]
    rewards = strict_verifier.verify(["42"] * len(completions), completions).rewards
    assert [c for c, r in zip(CODE_PAYLOADS, rewards) if r != 0.0] == []


def test_the_scoring_stage_is_strict_unless_configured():
    # The default, of both; no pool is started.
    assert MathVerifier().strict is True and Scoring().verifier.strict is True
    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1, strict=False)))
    try:
        correct, _ = scoring.verify(["42"], ["\\boxed{(lambda: 42)()}"], torch.tensor([False]))
        assert correct.tolist() == [1.0]  # lenient, as configured: math-verify reads the 42 out of the code
    finally:
        scoring.close()
