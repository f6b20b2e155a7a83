"""Sampling metrics over problems with n scored samples each, as torchmetrics `Metric`s.

Summed states, so the values are exact across ranks (torchmetrics all-reduces the sums).

    pass@k = E_problems[ 1 − C(n−c, k) / C(n, k) ]   (unbiased; Chen et al. 2021, HumanEval)

pass@1 is the mean accuracy over the n samples (mean@n). maj@k is the accuracy of the majority answer
among the first k samples (a tie counts the expected credit of a random tie-break). The ratio of binomials is computed as
Π_{i<k} (n−c−i)/(n−i): every factor lies in [0, 1], so there is no overflow or cancellation.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def pass_at_k(num_correct: torch.Tensor, num_samples: int | torch.Tensor, k: int) -> torch.Tensor:
    """Per-problem unbiased pass@k [P] from the number of correct samples c [P] out of n."""
    c = num_correct.double()
    n = torch.as_tensor(num_samples, dtype=torch.float64, device=c.device).expand_as(c)
    if k < 1 or (n < k).any():
        raise ValueError(f"pass@{k} needs 1 ≤ k ≤ n samples per problem (n = {int(n.min())})")
    i = torch.arange(k, dtype=torch.float64, device=c.device)
    all_wrong = ((n - c)[:, None] - i).clamp(min=0) / (n[:, None] - i)  # P(the i-th draw is wrong | …)
    return 1.0 - all_wrong.prod(-1)


def majority_credit(answers: list[str | None], correct: list[bool]) -> float:
    """Credit of a majority vote over one problem's samples: answers compared as stripped strings
    (the extracted `\\boxed{}` content); samples without an answer do not vote; a tie between answers
    gives the fraction of the tied answers that are correct."""
    votes: dict[str, list] = {}
    for answer, ok in zip(answers, correct):
        if answer is not None and answer.strip():
            votes.setdefault(answer.strip(), [0, bool(ok)])[0] += 1
    if not votes:
        return 0.0
    top = max(count for count, _ in votes.values())
    tied = [ok for count, ok in votes.values() if count == top]
    return sum(tied) / len(tied)


class _ProblemMean(Metric):
    """Mean of a per-problem value over problems, with its standard error; summed states."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_sq", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def _add(self, values: torch.Tensor) -> None:
        values = values.double().to(self.total.device)
        self.total += values.sum()
        self.total_sq += (values**2).sum()
        self.problems += values.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.problems.clamp(min=1)

    def standard_error(self) -> torch.Tensor:
        """Standard error of the mean over problems (synchronised across ranks like `compute`)."""
        with self.sync_context():
            n = self.problems.clamp(min=1)
            mean = self.total / n
            var = (self.total_sq / n - mean**2).clamp(min=0)
            return (var / (self.problems - 1).clamp(min=1)).sqrt()


class PassAtK(_ProblemMean):
    """Unbiased pass@k over problems."""

    def __init__(self, k: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k

    def update(self, correct: torch.Tensor) -> None:
        """`correct`: [P, n] verdicts (bool or 0/1) of n samples for each of P problems."""
        self._add(pass_at_k(correct.double().sum(-1), correct.shape[-1], self.k))


class MeanAtN(PassAtK):
    """mean@n: the accuracy of single samples averaged over the n per problem (pass@1)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(k=1, **kwargs)


class MajAtK(_ProblemMean):
    """maj@k: accuracy of the majority answer among the first k of each problem's samples."""

    def __init__(self, k: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k

    def update(self, answers: list[list[str | None]], correct: torch.Tensor) -> None:
        """`answers`: P lists of n extracted answers (None: no answer); `correct`: [P, n] verdicts."""
        if correct.shape[-1] < self.k:
            raise ValueError(f"maj@{self.k} needs ≥ {self.k} samples per problem, got {correct.shape[-1]}")
        credit = [majority_credit(a[: self.k], c[: self.k].tolist()) for a, c in zip(answers, correct)]
        self._add(torch.tensor(credit, dtype=torch.float64))
