"""The source papers' claims that `make results` checks, and each one's verdict at this scale: a claim is
reproduced when the paired difference's 95% interval lies entirely on its side of 0 (or, for a claim of
equality, within ±EQUAL_MARGIN)."""

from __future__ import annotations

import math

from rlvr_lightning.results.stats import METRICS, PresetRuns, baseline_of, fmt, paired_difference, unpaired_seeds

EQUAL_MARGIN = 0.02  # a claim of equality holds when the paired difference's interval lies within ±this
# (paper claim, preset, metric column, +1: the preset should be higher than its baseline, 0: equal to it
# [, the baseline when it is not the GRPO run with the same K])
CLAIMS = [
    ("THR, p < 0 raises pass@k (exploration)", "thr-explore", "pass@8", +1),
    ("THR, p > 0 raises greedy accuracy (exploitation)", "thr", "greedy", +1),
    ("REAL is at least as good as GRPO at equal updates", "real", "val/accuracy", +1),
    ("REAL keeps its entropy where GRPO's collapses", "real", "entropy (last 10)", +1),
    ("REAL-BCE above the GRPO baseline (the paper: above DAPO)", "real-bce", "val/accuracy", +1),
    ("OAR-P above GRPO", "oar-p", "val/accuracy", +1),
    ("OAR-G above GRPO", "oar-g", "val/accuracy", +1),
    ("CISPO learns at least as fast as GRPO at equal updates", "cispo", "val/accuracy", +1),
    ("Pass@k training raises pass@k", "passk", "pass@8", +1),
    ("REINFORCE++-baseline above GRPO", "reinforce-pp", "val/accuracy", +1),
    ("GMPO above GRPO at equal updates", "gmpo", "val/accuracy", +1),
    ("SAPO above GRPO at equal updates", "sapo", "val/accuracy", +1),
    ("Clip-Cov keeps entropy above GRPO's", "clip-cov", "entropy (last 10)", +1),
    ("KL-Cov keeps entropy above GRPO's", "kl-cov", "entropy (last 10)", +1),
    ("Clip-Cov above GRPO at equal updates", "clip-cov", "val/accuracy", +1),
    ("KL-Cov above GRPO at equal updates", "kl-cov", "val/accuracy", +1),
    # RLOO's advantage is G/(G−1) × Dr. GRPO's: AdamW is blind to that scale, up to its ε and the clip.
    ("RLOO equals Dr. GRPO (GRPO without std, scaled)", "rloo", "val/accuracy", 0, "dr-grpo"),
    ("DPPO's trust region above GRPO at equal updates", "dppo-tv", "val/accuracy", +1),
    # MaxRL's claim: a better pass@k than GRPO at the same samples (it optimises the likelihood of success).
    ("MaxRL raises pass@8 above GRPO", "maxrl", "pass@8", +1),
    # Asynchronous RL's premise: training two versions off policy (with partial rollouts) learns as synchronous does.
    ("GRPO two versions ahead with partial rollouts learns as synchronous GRPO", "grpo-async", "val/accuracy", 0),
    # ToRL's and SimpleTIR's premise, on a task the model cannot do in its head: RL teaches it to call the tool.
    ("The Python tool raises accuracy above GRPO without it", "grpo-tir", "val/accuracy", +1),
    # On-policy distillation's premise: a stronger teacher's per-token signal teaches the student faster than the
    # reward alone, on its own and beside it.
    ("On-policy distillation from a stronger teacher above GRPO", "opd", "val/accuracy", +1),
    ("GRPO with a teacher's per-token signal above GRPO alone", "grpo-opd", "val/accuracy", +1),
]


def verdict(mean: float, half: float, direction: int) -> str:
    """Whether a paired difference's interval lies on the claimed side of 0, the other side, or spans it;
    for a claim of equality (`direction` 0), whether it lies within ±EQUAL_MARGIN or excludes 0."""
    if math.isnan(half):
        return "one seed: no interval"
    if direction == 0:
        if -EQUAL_MARGIN < mean - half and mean + half < EQUAL_MARGIN:
            return f"reproduced (equal within ±{EQUAL_MARGIN})"
        if mean - half > 0 or mean + half < 0:
            return "contradicted (the interval excludes 0)"
        return f"not resolved (the interval is wider than ±{EQUAL_MARGIN})"
    lo, hi = sorted((direction * (mean - half), direction * (mean + half)))
    if lo > 0:
        return "reproduced"
    if hi < 0:
        return "contradicted"
    return "not resolved (the interval contains 0)"


def claims_table(results: dict[str, PresetRuns]) -> list[str]:
    lines = [
        "| claim | preset − baseline | metric | difference (95% interval) | seeds | at this scale |",
        "|---|---|---|---|---|---|",
    ]
    by_column = {col: (key, how) for col, key, how in METRICS}
    for claim, preset, column, direction, *baseline in CLAIMS:
        pr = results.get(preset)
        base = baseline[0] if baseline else baseline_of(preset, pr.steps_per_batch) if pr else None
        if pr is None or base not in results:
            lines.append(f"| {claim} | {preset} − {base or 'its baseline'} | {column} | – | 0 | not run |")
            continue
        mean, half, n = paired_difference(pr, results[base], *by_column[column])
        if n == 0:
            why = (
                "not comparable (the runs began from different starts)"
                if unpaired_seeds(pr, results[base])
                else "no seed in common"
            )
            lines.append(f"| {claim} | {preset} − {base} | {column} | – | 0 | {why} |")
            continue
        lines.append(
            f"| {claim} | {preset} − {base} | {column} | {fmt(mean, half)} | {n} | {verdict(mean, half, direction)} |"
        )
    return lines
