"""Sampling metrics over problems with n scored samples each, as torchmetrics `Metric`s.

Summed states, so the values are exact across ranks (torchmetrics all-reduces the sums).

    pass@k = E_problems[ 1 − C(n−c, k) / C(n, k) ]   (unbiased; Chen et al. 2021, HumanEval)

pass@1 is the mean accuracy over the n samples (mean@n). The ratio of binomials is computed as
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


class PassAtK(Metric):
    """pass@k over problems, with its standard error across problems."""

    full_state_update = False

    def __init__(self, k: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_sq", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor) -> None:
        """`correct`: [P, n] verdicts (bool or 0/1) of n samples for each of P problems."""
        values = pass_at_k(correct.double().sum(-1), correct.shape[-1], self.k)
        self.total += values.sum()
        self.total_sq += (values**2).sum()
        self.problems += values.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.problems.clamp(min=1)

    def standard_error(self) -> torch.Tensor:
        mean = self.compute()
        var = (self.total_sq / self.problems.clamp(min=1) - mean**2).clamp(min=0)
        return (var / (self.problems - 1).clamp(min=1)).sqrt()
