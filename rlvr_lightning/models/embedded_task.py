"""The embedded default task: short arithmetic word problems `a+b±c` with `\\boxed{}` answers.

Every problem is enumerated once (a, b ≤ 20, c ≤ 9, + or −: 8820 problems) and split into
train/test by a seeded permutation, so the held-out set never leaks into training.

The supervised warm start learns from *flawed* demonstrations (docs/embedded-default.md):
many end in the wrong format (`Answer:v` instead of `\\boxed{v}`) and some carry an arithmetic
slip. The verifier only rewards a correct boxed answer, so the warm-started policy has a partial
success rate and RL has a clear, fast signal to learn: the answer format first, then accuracy,
the way real models first learn the format under RLVR.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_AB, MAX_C = 20, 9
PROMPT_TEMPLATE = "What is {a}+{b}{op}{c}?\n"


@dataclass(frozen=True)
class ArithmeticProblem:
    a: int
    b: int
    op: str  # "+" or "-"
    c: int

    @property
    def partial(self) -> int:
        return self.a + self.b

    @property
    def value(self) -> int:
        return self.partial + self.c if self.op == "+" else self.partial - self.c

    @property
    def id(self) -> str:
        return f"arith:{self.a}+{self.b}{self.op}{self.c}"

    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(a=self.a, b=self.b, op=self.op, c=self.c)

    def solution(self, value: int | None = None, boxed: bool = True) -> str:
        """The worked solution `a+b=s,s±c=v.` followed by the answer in the chosen format."""
        v = self.value if value is None else value
        steps = f"{self.a}+{self.b}={self.partial},{self.partial}{self.op}{self.c}={v}."
        return steps + (f"\\boxed{{{v}}}" if boxed else f"Answer:{v}")


def all_problems() -> list[ArithmeticProblem]:
    return [
        ArithmeticProblem(a, b, op, c)
        for a in range(MAX_AB + 1)
        for b in range(MAX_AB + 1)
        for op in "+-"
        for c in range(MAX_C + 1)
    ]


def train_test_split(seed: int = 0, test_size: int = 500) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    return problems[test_size:], problems[:test_size]


def flawed_demonstration(
    problem: ArithmeticProblem, rng: random.Random, wrong_format_prob: float, slip_prob: float
) -> str:
    """A warm-start target: right format with prob 1−wrong_format_prob; an off-by-one/two slip with slip_prob."""
    value = problem.value
    if rng.random() < slip_prob:
        value += rng.choice([-2, -1, 1, 2])
    return problem.solution(value=value, boxed=rng.random() >= wrong_format_prob)
