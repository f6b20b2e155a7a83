"""pass@k against brute-force enumeration of k-subsets (issue 7 acceptance 1, the pass@k part)."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlvr_lightning.metrics import PassAtK, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_of_all_subsets(n):
    for c in range(n + 1):  # includes c = 0 and c = n
        for k in range(1, n + 1):  # includes k = n
            got = pass_at_k(torch.tensor([c]), n, k).item()
            assert got == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_mean_accuracy_and_large_n_is_stable():
    c = torch.tensor([0, 3, 7, 10])
    torch.testing.assert_close(pass_at_k(c, 10, 1), c.double() / 10)
    # C(1000, 500) overflows doubles; the product form does not.
    value = pass_at_k(torch.tensor([1]), 1000, 500).item()
    assert value == pytest.approx(0.5)


def test_k_larger_than_n_is_refused():
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(torch.tensor([1]), 4, 5)


def test_metric_accumulates_over_updates_with_standard_error():
    metric = PassAtK(k=2)
    a = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    b = torch.tensor([[1, 1, 0, 0]])
    metric.update(a)
    metric.update(b)
    per_problem = torch.tensor([brute_force(4, 1, 2), 0.0, brute_force(4, 2, 2)], dtype=torch.float64)
    assert metric.compute().item() == pytest.approx(per_problem.mean().item())
    assert metric.standard_error().item() == pytest.approx((per_problem.std() / 3**0.5).item())
