"""The embedded tool task: three-digit multiplication, `What is 347*862?`, with `\\boxed{}` answers.

The embedded model (1.1M parameters, no scratchpad) cannot multiply three-digit numbers in its head, but it can
copy: the factors into a Python block, and the tool's output into its answer. So the task measures whether RL
teaches a model to call the tool (docs/tools.md, `grpo-tir`).

The warm start (`embedded-tir`) learns from flawed demonstrations: some answer in the head (the right product,
which a model this size cannot learn to compute, so its own head answers are mostly wrong); the others call the tool

    ```python
    print(347*862)
    ```
    ```output
    299114
    ```
    \\boxed{299114}

and some of those mistype a factor (the output is then right for the wrong product). The output block is what the
tool appends, so it is left out of the warm start's loss, as observations are left out of RL's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LOW, HIGH = 100, 999
TRAIN_SIZE, TEST_SIZE = 20_000, 500
# The Python tool's default markers (`PythonToolSettings`; the tests check that the two agree).
CODE_START, CODE_END = "```python\n", "\n```\n"
OUTPUT_START, OUTPUT_END = "```output\n", "\n```\n"


@dataclass(frozen=True)
class MultiplicationProblem:
    a: int
    b: int

    @property
    def value(self) -> int:
        return self.a * self.b

    @property
    def id(self) -> str:
        return f"mul:{self.a}*{self.b}"

    def prompt(self) -> str:
        return f"What is {self.a}*{self.b}?\n"


def train_test_split(seed: int = 0) -> tuple[list[MultiplicationProblem], list[MultiplicationProblem]]:
    """TRAIN_SIZE and TEST_SIZE distinct problems drawn by a seeded generator (the whole space, 810,000
    problems, is far more than a run sees); the held-out ones never appear in training."""
    rng = random.Random(seed)
    drawn: dict[tuple[int, int], None] = {}  # insertion-ordered: the split does not depend on set iteration
    while len(drawn) < TRAIN_SIZE + TEST_SIZE:
        drawn.setdefault((rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)))
    problems = [MultiplicationProblem(a, b) for a, b in drawn]
    return problems[TEST_SIZE:], problems[:TEST_SIZE]


def mistyped(n: int, rng: random.Random) -> int:
    """`n` with one of its three digits replaced by another (the leading one never by 0)."""
    digits = list(str(n))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def flawed_demonstration(
    problem: MultiplicationProblem, rng: random.Random, tool_prob: float, slip_prob: float
) -> list[tuple[str, bool]]:
    """A warm-start target as (text, trained) pieces: the tool's output block is not trained on. A call with
    probability `tool_prob`, which mistypes a factor with probability `slip_prob`; else the answer in the head."""
    if rng.random() >= tool_prob:
        return [(f"\\boxed{{{problem.value}}}", True)]
    a, b = problem.a, problem.b
    if rng.random() < slip_prob:
        a, b = (mistyped(a, rng), b) if rng.random() < 0.5 else (a, mistyped(b, rng))
    call = f"{CODE_START}print({a}*{b}){CODE_END}"
    return [(call, True), (f"{OUTPUT_START}{a * b}{OUTPUT_END}", False), (f"\\boxed{{{a * b}}}", True)]
