"""Sampling metrics over problems with n scored samples each, as torchmetrics `Metric`s.

Summed states, so the values are exact across ranks (torchmetrics all-reduces the sums).

    pass@k = E_problems[ 1 − C(n−c, k) / C(n, k) ]   (unbiased; Chen et al. 2021, HumanEval)

pass@1 is the mean accuracy over the n samples (mean@n). maj@k is the accuracy of the majority answer
among the first k samples (a tie counts the expected credit of a random tie-break). The ratio of binomials is computed as
Π_{i<k} (n−c−i)/(n−i): every factor lies in [0, 1], so there is no overflow or cancellation.

Per-token statistics of a whole rollout batch (THR, OAR) are summarised in bounded memory, whatever
the batch size: `RunningStats` keeps what running totals give exactly (counts, fractions, extremes),
`StreamSample` a fixed-size uniform sample for the rest (quantiles, rank correlations).
"""

from __future__ import annotations

import math

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


class StreamSample:
    """A uniform random sample, without replacement, of at most `capacity` elements of a stream of
    aligned 1-D columns (e.g. |THR| and entropy per token), in O(capacity) memory.

    Bottom-k sampling: every incoming element gets an independent U(0, 1) key from a seeded generator,
    and the sample is the `capacity` elements with the smallest keys seen so far. Any `capacity`
    elements of the stream are equally likely to hold the smallest keys, so at every point the sample
    is an exact uniform sample without replacement, however the stream was chunked; one top-k per chunk,
    vectorised. An element's columns share its key, so sampled values stay paired. While the stream has
    at most `capacity` elements the sample is the whole stream, so statistics of the sample are those of
    the stream exactly. Kept elements stay in stream order. Held on the CPU; torch.quantile accepts the
    sample as long as `capacity` ≤ 2^24 (the whole stream may be far longer).
    """

    def __init__(self, capacity: int = 65_536, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"StreamSample needs capacity ≥ 1, got {capacity}")
        self.capacity = capacity
        self.seen = 0  # elements added so far
        self._generator = torch.Generator().manual_seed(seed)
        self._keys = torch.empty(0, dtype=torch.float64)
        self._columns: tuple[torch.Tensor, ...] = ()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, *columns: torch.Tensor) -> None:
        """Add a chunk of elements: equal-length 1-D tensors, one per column (any device)."""
        n = columns[0].numel() if columns else 0
        if not columns or any(c.dim() != 1 or c.numel() != n for c in columns):
            raise ValueError("StreamSample.add takes one or more equal-length 1-D tensors")
        if self._columns and len(columns) != len(self._columns):
            raise ValueError(f"StreamSample holds {len(self._columns)} columns, got {len(columns)}")
        keys = torch.rand(n, generator=self._generator, dtype=torch.float64)
        keep = self._smallest(keys)  # a chunk longer than the capacity is cut down first: O(capacity) held
        if keep is not None:
            keys = keys[keep]
        new = [(c if keep is None else c[keep.to(c.device)]).detach().cpu() for c in columns]
        keys = torch.cat([self._keys, keys])
        held = [torch.cat([old, c]) for old, c in zip(self._columns, new)] if self._columns else new
        keep = self._smallest(keys)
        if keep is not None:
            keys, held = keys[keep], [c[keep] for c in held]
        self._keys, self._columns = keys, tuple(held)
        self.seen += n

    def _smallest(self, keys: torch.Tensor) -> torch.Tensor | None:
        """Positions of the `capacity` smallest keys, in order; None when all fit."""
        if len(keys) <= self.capacity:
            return None
        return keys.topk(self.capacity, largest=False).indices.sort().values

    def columns(self) -> tuple[torch.Tensor, ...]:
        """The sampled values, one tensor per column, aligned (empty tuple before the first `add`)."""
        return self._columns

    def quantiles(self, q: list[float], column: int = 0) -> torch.Tensor:
        """torch.quantile of a column of the sample at the levels `q` (the stream's own when it fits)."""
        values = self._columns[column]
        return torch.quantile(values, torch.tensor(q, dtype=values.dtype))


class RunningStats:
    """Exact running count, and sum, minimum and maximum of each named stream, in O(1) memory.

    Counts, fractions (the mean of a 0/1 stream) and extremes need no sample: float64 running totals are
    exact at any stream length (counts up to 2^53) and whatever the chunking, unlike a sample's estimate.
    """

    def __init__(self) -> None:
        self.count = 0  # elements added so far (each `add` adds one per position of its equal-length streams)
        self._sum: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def add(self, **streams: torch.Tensor) -> None:
        """Add a chunk: equal-length 1-D tensors (bool or numeric), by name."""
        lengths = {v.numel() for v in streams.values()}
        if len(lengths) != 1 or any(v.dim() != 1 for v in streams.values()):
            raise ValueError("RunningStats.add takes one or more equal-length 1-D tensors")
        n = lengths.pop()
        self.count += n
        if n == 0:
            return
        for name, values in streams.items():
            values = values.detach().double()
            self._sum[name] = self._sum.get(name, 0.0) + values.sum().item()
            self._min[name] = min(self._min.get(name, math.inf), values.min().item())
            self._max[name] = max(self._max.get(name, -math.inf), values.max().item())

    def mean(self, name: str) -> float:
        return self._sum[name] / self.count

    def min(self, name: str) -> float:
        return self._min[name]

    def max(self, name: str) -> float:
        return self._max[name]
