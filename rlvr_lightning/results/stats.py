"""The statistics of `make results` over seeds: which metrics a run is summarised by, a preset's runs,
Student-t intervals, and paired differences against the GRPO run of the same seed and K.

Runs are paired by seed (the same warm start, prompt order and held-out problems), so seed-to-seed noise
largely cancels; a pair whose runs began from different weights or another held-out evaluation is left out
(`same_start`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from rlvr_lightning.compare import PLOTS, RunHistory, summary

METRICS = [  # (column, metric key, summary of one run's history: the final value or the mean of the last 10)
    ("val/accuracy", "val/accuracy", "last"),
    ("greedy", "val/accuracy_greedy", "last"),
    ("pass@4", "val/pass_at_4", "last"),
    ("pass@8", "val/pass_at_8", "last"),
    ("maj@8", "val/maj_at_8", "last"),
    ("train accuracy (last 10)", "train/accuracy", "tail_mean"),
    ("entropy (last 10)", "train/entropy", "tail_mean"),
    ("s / rollout batch", "time/step", "mean"),
    ("answers calling the tool", "val/tool_answers_with_call", "last"),  # a column only where a preset has a tool
]
BASELINES = {1: "grpo", 4: "grpo-real-baseline"}  # the GRPO run with the same optimizer steps per rollout batch
# Presets on another task than the default's: the GRPO run on the same task and warm start.
TASK_BASELINES = {"grpo-tir": "grpo-tir-baseline"}


def baseline_of(preset: str, steps_per_batch: int) -> str | None:
    """The preset a preset's paired differences are taken against (None: itself, or none)."""
    base = TASK_BASELINES.get(preset) or BASELINES.get(steps_per_batch)
    return None if base == preset or preset in TASK_BASELINES.values() else base


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the Student-t interval) of `values`; the half-width is nan for one value."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, float(t.ppf(0.5 + level / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def fmt(mean: float, half: float) -> str:
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


@dataclass
class PresetRuns:
    name: str
    steps_per_batch: int
    runs: dict[int, RunHistory]  # seed → its run

    def values(self, key: str, how: str) -> dict[int, float]:
        """seed → the run's summary of metric `key` (seeds whose run lacks the metric are left out)."""
        out = {seed: summary(r.history.get(key, []), how) for seed, r in self.runs.items()}
        return {seed: v for seed, v in out.items() if v is not None}

    def before(self, key: str) -> float | None:
        firsts = [r.history[key][0][1] for r in self.runs.values() if r.history.get(key)]
        return statistics.fmean(firsts) if firsts else None

    def mean_history(self) -> RunHistory:
        """The seeds' histories averaged step by step, for the plots."""
        history = {}
        for _, key, _ in PLOTS:
            by_step: dict[int, list[float]] = {}
            for r in self.runs.values():
                for step, v in r.history.get(key, []):
                    by_step.setdefault(step, []).append(v)
            history[key] = sorted((s, statistics.fmean(v)) for s, v in by_step.items() if len(v) == len(self.runs))
        algorithm = next(iter(self.runs.values())).algorithm
        return RunHistory(self.name, "", "FINISHED", algorithm, history)


# Step 0's greedy held-out accuracy: one value per warm start, verifier and evaluation, whatever the seed.
START_KEY = next(key for column, key, _ in METRICS if column == "greedy")


def same_start(a: RunHistory, b: RunHistory, same_evaluation: bool = True) -> bool:
    """Whether two runs began from the same weights and held-out evaluation: the same warm-start digest where
    both runs tagged one, and equal step-0 greedy accuracies. That accuracy depends on no seed, so it differs
    only where the weights, the verifier or the evaluation did (runs on another build of the warm start, say);
    such runs are not paired. Runs without either cannot tell. `same_evaluation` False: the weights only (a
    preset and its task baseline evaluate differently by design: with the tool and without)."""
    if a.warm_start and b.warm_start and a.warm_start != b.warm_start:
        return False
    if not same_evaluation:
        return True
    first_a, first_b = a.history.get(START_KEY, [])[:1], b.history.get(START_KEY, [])[:1]
    return not first_a or not first_b or list(first_a[0]) == list(first_b[0])


def unpaired_seeds(preset: PresetRuns, baseline: PresetRuns) -> list[int]:
    """The seeds both finished whose runs began from different evaluations (`same_start`)."""
    both = sorted(preset.runs.keys() & baseline.runs.keys())
    evaluation = TASK_BASELINES.get(preset.name) != baseline.name
    return [s for s in both if not same_start(preset.runs[s], baseline.runs[s], evaluation)]


def paired_difference(preset: PresetRuns, baseline: PresetRuns, key: str, how: str) -> tuple[float, float, int]:
    """(mean, 95% half-width, seeds) of preset − baseline over the seeds both finished from the same start."""
    a, b = preset.values(key, how), baseline.values(key, how)
    skip = set(unpaired_seeds(preset, baseline))
    diffs = [a[s] - b[s] for s in sorted(a.keys() & b.keys()) if s not in skip]
    if not diffs:
        return math.nan, math.nan, 0
    return (*t_interval(diffs), len(diffs))
