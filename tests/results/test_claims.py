"""`make results` claims: a claim's verdict needs the whole interval of its paired difference on one side."""

from __future__ import annotations

import math

import pytest

from rlvr_lightning.results.claims import verdict


@pytest.mark.parametrize(
    "mean,half,direction,expected",
    [(0.05, 0.03, +1, "reproduced"), (-0.05, 0.03, +1, "contradicted"), (0.01, 0.03, +1, "not resolved"),
     (-0.05, 0.03, -1, "reproduced"), (0.05, math.nan, +1, "one seed"),
     # A claim of equality: the interval within ±0.02, excluding 0, or neither.
     (0.005, 0.01, 0, "reproduced"), (0.04, 0.01, 0, "contradicted"), (0.005, 0.03, 0, "not resolved"),
     (0.015, 0.02, 0, "not resolved")],
)  # fmt: skip
def test_verdict_needs_the_whole_interval_on_one_side(mean, half, direction, expected):
    assert verdict(mean, half, direction).startswith(expected)
