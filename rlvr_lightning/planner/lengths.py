"""The response lengths a plan assumes: a spread around the mean the user gives, as deterministic quantiles.

Published math RL runs average 0.2–0.3 of their length limit, and a rollout batch lasts as long as its
longest response, so a mean alone is not enough: the plan assumes the lengths are log-normal with
σ = SPREAD_SIGMA, clipped at the limit (a response the engine cuts off stops there), with the median
chosen so that the clipped mean is the mean given. The N lengths are the distribution's quantiles at
(i + ½)/N: no random numbers, the same plan every time. A mean at the limit puts every response there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

SPREAD_SIGMA = 1.0  # σ of log(length): an assumption (a wide spread, as in published length histograms of math RL)


@dataclass(frozen=True)
class LengthSpread:
    lengths: tuple[float, ...]  # ascending
    cap: int
    median: float  # of the log-normal before clipping (inf when every length is at the cap)
    sigma: float

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    @property
    def share_at_cap(self) -> float:
        return sum(1 for x in self.lengths if x >= self.cap) / len(self.lengths)

    def describe(self) -> str:
        if self.share_at_cap == 1:
            return f"every response at the limit ({self.cap} tokens)"
        return (
            f"response lengths log-normal, σ = {self.sigma:g}, median {self.median:.0f}, clipped at {self.cap}: "
            f"mean {self.mean:.0f}, longest {self.lengths[-1]:.0f}, {self.share_at_cap:.0%} at the limit"
        )


def response_lengths(mean: float, cap: int, n: int, sigma: float = SPREAD_SIGMA) -> LengthSpread:
    """`n` response lengths (ascending, not rounded) whose mean is `mean`, spread as the module says."""
    if not 0 < mean <= cap:
        raise ValueError(f"mean response length {mean} must be in (0, {cap}]")
    if mean >= cap:
        return LengthSpread((float(cap),) * n, cap, math.inf, sigma)
    z = [math.exp(sigma * NormalDist().inv_cdf((i + 0.5) / n)) for i in range(n)]

    def clipped_mean(log_median: float) -> float:
        return sum(min(cap, math.exp(log_median) * x) for x in z) / n

    # The clipped mean rises with the median from ~0 to the cap: bisect on log(median).
    lo, hi = math.log(mean) - 20 * sigma, math.log(cap) + 20 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    median = math.exp((lo + hi) / 2)
    return LengthSpread(tuple(min(cap, median * x) for x in z), cap, median, sigma)


def expected_longest(lengths: tuple[float, ...], rows: int) -> float:
    """The expected longest of `rows` lengths drawn from these (ascending, equally likely) quantiles: what
    a padded micro-batch of `rows` sequences is trimmed to."""
    n = len(lengths)
    return sum(x * (((i + 1) / n) ** rows - (i / n) ** rows) for i, x in enumerate(lengths))


def submission_order(n: int) -> list[int]:
    """A fixed interleaving of the ascending quantiles into the order the sequences reach the engine
    (long and short mixed, as sampled lengths are): position p gets quantile (p × s) mod n, s coprime to n
    near n/φ."""
    step = max(1, round(n / 1.618))
    while math.gcd(step, n) != 1:
        step += 1
    return [(p * step) % n for p in range(n)]
