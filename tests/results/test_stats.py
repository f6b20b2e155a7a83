"""`make results` statistics: intervals over seeds and paired differences against the GRPO run of the same
seed and K, leaving out the seeds whose runs began from different starts."""

from __future__ import annotations

import math

import pytest

from rlvr_lightning.compare import RunHistory
from rlvr_lightning.results.claims import claims_table
from rlvr_lightning.results.page import differences_table, start_sentence
from rlvr_lightning.results.stats import PresetRuns, paired_difference, t_interval


def test_t_interval_matches_the_textbook_formula():
    mean, half = t_interval([1.0, 2.0, 3.0])  # sd 1, n 3, t(0.975, 2) = 4.302653
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    mean, half = t_interval([0.5])
    assert mean == 0.5 and math.isnan(half)


def runs(name: str, finals: dict[int, float]) -> PresetRuns:
    hist = {s: RunHistory(f"{name}-seed{s}", "", "FINISHED", "GRPO", {"val/accuracy": [(0, 0.1), (60, v)]})
            for s, v in finals.items()}  # fmt: skip
    return PresetRuns(name, 1, hist)


def test_paired_difference_pairs_by_seed_and_skips_unpaired_seeds():
    # Seed-to-seed spread is large, the paired differences are constant 0.02: a zero-width interval.
    base = runs("grpo", {0: 0.10, 1: 0.30, 2: 0.50, 3: 0.9})
    other = runs("thr", {0: 0.12, 1: 0.32, 2: 0.52})  # seed 3 did not finish
    mean, half, n = paired_difference(other, base, "val/accuracy", "last")
    assert n == 3 and mean == pytest.approx(0.02) and half == pytest.approx(0.0, abs=1e-12)
    unpaired_half = t_interval([0.12, 0.32, 0.52])[1]
    assert unpaired_half > 0.4  # what comparing the means without pairing would have to allow


def with_start(pr: PresetRuns, greedy_before: dict[int, float], commit: str) -> PresetRuns:
    for seed, r in pr.runs.items():
        r.history["val/accuracy_greedy"] = [(0, greedy_before[seed]), (60, 0.5)]
        r.commit = commit
    return pr


def test_runs_that_began_from_different_evaluations_are_not_paired():
    """A baseline recorded before a verifier fix began from another greedy accuracy than a preset run after it:
    their difference would be the fix's, so those seeds are left out, and the page says which and why."""
    from rlvr_lightning.results.claims import CLAIMS

    base = with_start(runs("grpo", {0: 0.10, 1: 0.30, 2: 0.50}), {0: 0.345, 1: 0.345, 2: 0.45}, "old")
    other = with_start(runs("maxrl", {0: 0.12, 1: 0.32, 2: 0.55}), {0: 0.45, 1: 0.45, 2: 0.45}, "new")
    mean, half, n = paired_difference(other, base, "val/accuracy", "last")
    assert n == 1 and mean == pytest.approx(0.05) and math.isnan(half)  # seed 2 alone began where its baseline did
    results = {"grpo": base, "maxrl": other}
    assert "Not paired" in differences_table(results)[-1] and "`maxrl` seeds 0, 1" in differences_table(results)[-1]
    assert "0.345 at `old`; 0.450 at `new`" in start_sentence(results)
    with_start(base, {0: 0.345, 1: 0.345, 2: 0.345}, "old")
    claim = next(c[0] for c in CLAIMS if c[1] == "maxrl")
    row = next(line for line in claims_table(results) if line.startswith(f"| {claim} |"))
    assert row.endswith("| – | 0 | not comparable (the runs began from different starts) |")
    same = with_start(runs("maxrl", {0: 0.12}), {0: 0.345}, "old")
    assert start_sentence({"grpo": base, "maxrl": same}).startswith("`before` is the same warm start")
    assert paired_difference(same, base, "val/accuracy", "last")[2] == 1
    base.runs[0].warm_start, same.runs[0].warm_start = "66d538c8f3b0", "0123456789ab"  # another build, same greedy
    assert paired_difference(same, base, "val/accuracy", "last")[2] == 0
