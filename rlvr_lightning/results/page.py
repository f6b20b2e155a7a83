"""Rendering `docs/RESULTS.md` from the run records: the metrics table, the paired differences, the claims'
verdicts and the mean curves; and the README's block of figures between its two markers."""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections import Counter
from pathlib import Path

from rlvr_lightning.compare import PLOTS, plot
from rlvr_lightning.results.claims import EQUAL_MARGIN, claims_table
from rlvr_lightning.results.grid import preset_model
from rlvr_lightning.results.records import load_presets, records_dir
from rlvr_lightning.results.stats import (
    METRICS,
    START_KEY,
    PresetRuns,
    baseline_of,
    fmt,
    paired_difference,
    t_interval,
    unpaired_seeds,
)
from rlvr_lightning.run_records import read_records


def metric_cell(pr: PresetRuns, key: str, how: str) -> str:
    """Mean ± 95% half-width over seeds; held-out metrics (`last`) as `before → after`."""
    values = list(pr.values(key, how).values())
    cell = fmt(*t_interval(values)) if values else "–"
    before = pr.before(key) if how == "last" else None
    return cell if before is None else f"{before:.3f} → {cell}"


def logged_metrics(results: dict[str, PresetRuns]) -> list[tuple[str, str, str]]:
    """The METRICS some run of the page logged (the tool's columns only where a preset has the tool)."""
    return [m for m in METRICS if any(pr.values(m[1], m[2]) for pr in results.values())]


def metrics_table(results: dict[str, PresetRuns]) -> list[str]:
    metrics = logged_metrics(results)
    header = ["preset", "algorithm", "K", "seeds", *[col for col, _, _ in metrics]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, pr in results.items():
        cells = [name, next(iter(pr.runs.values())).algorithm, str(pr.steps_per_batch), str(len(pr.runs))]
        cells += [metric_cell(pr, key, how) for _, key, how in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def differences_table(results: dict[str, PresetRuns]) -> list[str]:
    columns = [m for m in logged_metrics(results) if m[2] != "mean"]  # time is not paired noise: in the table above
    header = ["preset", "baseline", *[f"Δ {col}" for col, _, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    unpaired = []
    for name, pr in results.items():
        base = baseline_of(name, pr.steps_per_batch)
        if base is None or base not in results:
            continue
        cells = [name, base]
        for _, key, how in columns:
            mean, half, n = paired_difference(pr, results[base], key, how)
            cells.append("–" if n == 0 else fmt(mean, half))
        lines.append("| " + " | ".join(cells) + " |")
        if seeds := unpaired_seeds(pr, results[base]):
            unpaired.append(f"`{name}` seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}")
    if unpaired:
        lines += [
            "",
            "Not paired, their baseline's run having begun from other weights or another held-out evaluation "
            "(another warm-start digest, or another step-0 greedy accuracy: another verifier or evaluation; rerun "
            "both at one commit on one warm start): " + "; ".join(unpaired) + ".",
        ]
    return lines


README_BEGIN, README_END = "<!-- make results: begin -->", "<!-- make results: end -->"
README_COLUMNS = ["val/accuracy", "greedy", "pass@4", "pass@8"]  # times: the page (runs may share a machine)


def readme_table(results: dict[str, PresetRuns], page: Path, header: str) -> list[str]:
    """The README's figures: a few columns of the results page, with where and when they come from."""
    by_column = {col: (key, how) for col, key, how in METRICS}
    lines = [
        header,
        "",
        "| `make train ALGO=` | K | seeds | " + " | ".join(README_COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(README_COLUMNS),
    ]
    for name, pr in results.items():
        cells = [metric_cell(pr, *by_column[col]) for col in README_COLUMNS]
        lines.append(f"| `{name}` | {pr.steps_per_batch} | {len(pr.runs)} | " + " | ".join(cells) + " |")
    return [*lines, "", f"Intervals, paired differences and the papers' claims: [{page}]({page})."]


def update_readme(readme: Path, lines: list[str]) -> None:
    """Replace what lies between the README's two markers; a README without them is an error."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"error: {readme} has no '{README_BEGIN}' … '{README_END}' block to rewrite")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    readme.write_text(head + README_BEGIN + "\n" + "\n".join(lines) + "\n" + README_END + tail)


def start_sentence(results: dict[str, PresetRuns]) -> str:
    """What `before` is: one start for every run, or the runs' several step-0 greedy accuracies by commit."""
    starts: dict[float, set[str]] = {}
    for pr in results.values():
        for r in pr.runs.values():
            if first := r.history.get(START_KEY, [])[:1]:
                starts.setdefault(first[0][1], set()).add(r.commit or "not recorded")
    if len(starts) <= 1:
        return "`before` is the same warm start for every preset"
    by_start = "; ".join(f"{v:.3f} at {', '.join(f'`{c}`' for c in sorted(cs))}" for v, cs in sorted(starts.items()))
    return f"`before` is not one start: the runs' step-0 greedy accuracy is {by_start}"


def warm_starts(args: argparse.Namespace, presets: list[Path]) -> tuple[str, str]:
    """The page title's `on …` and the workload's warm starts: configs/base.yaml's (or `--model`) for every preset,
    and those of the presets that name their own (with their own task)."""
    default = preset_model(args.configs / "base.yaml", args)
    by_model: dict[str, list[str]] = {}
    for preset in presets:
        by_model.setdefault(preset_model(preset, args), []).append(preset.stem)
    title = ", ".join(f"`{m}`" for m in by_model)
    others = [f"`{', '.join(names)}` as `{model}`" for model, names in by_model.items() if model != default]
    if not others:
        return title, f"warm-started as `{default}`, on the embedded arithmetic task"
    if default not in by_model:  # every preset names its own
        return title, f"warm-started as each preset names ({'; '.join(others)}), on the task it names"
    return title, (
        f"warm-started as `{default}` on the embedded arithmetic task ({'; '.join(others)}, on the task their preset "
        "names)"
    )


def write_page(args: argparse.Namespace, presets: list[Path], outcomes: dict[str, tuple[int, float]]) -> Path:
    results = load_presets(read_records(records_dir(args)), presets, args)
    figures = args.out.parent / args.out.stem.lower()  # docs/RESULTS.md → docs/results/: one folder per page
    figures.mkdir(parents=True, exist_ok=True)
    curves = [pr.mean_history() for pr in results.values()]
    images = [
        plot(curves, key, f"{key} vs rollout batch, mean of seeds", smooth, figures / f"{name}.png")
        for name, key, smooth in PLOTS
        if any(c.history.get(key) for c in curves)
    ]
    # The runs' own commits (a resumed `make results` may mix several), not this checkout's.
    commits = Counter(r.commit or "not recorded" for pr in results.values() for r in pr.runs.values())
    commit = ", ".join(
        f"`{c}` ({n} run{'s' * (n != 1)})" if len(commits) > 1 else f"`{c}`" for c, n in commits.most_common()
    )
    failed = [f"`{n}` (exit {rc}, log `{args.log_dir / n}.log`)" for n, (rc, _) in outcomes.items() if rc != 0]
    seeds = " ".join(map(str, args.seed_list))
    date = time.strftime("%Y-%m-%d", time.gmtime())
    command = " ".join(
        ["python -m rlvr_lightning.results", *(a for a in args.argv if a not in ("--skip-training", "--resume"))]
    )
    command = command.replace(f" --readme {args.readme}", "") if args.readme else command
    hours = sum(r.seconds for pr in results.values() for r in pr.runs.values() if not math.isnan(r.seconds)) / 3600
    on, warm_started = warm_starts(args, presets)
    lines = [
        f"# Results: {'every preset' if args.algos is None else ', '.join(args.algos)} on {on}, over seeds",
        "",
        f"Generated by `{command}` (`make results ARGS='…'`); do not edit by hand.",
        "",
        f"- Workload: the embedded tiny Qwen2 policy, {warm_started}, {args.rollout_batches} "
        "rollout batches of 16 prompts × 8 samples per run (`configs/base.yaml` + `configs/algo/<preset>.yaml`), "
        f"seeds {seeds} (`seed_everything` and `data.seed`: sampling and prompt order). K = optimizer steps per "
        "rollout batch; every preset gets K × the same rollout batches.",
        f"- Evaluation: {args.val_size} held-out problems × 8 samples at temperature 1 before training and at the end; "
        "greedy = temperature 0. Cells are the mean over seeds ± the half-width of its 95% Student-t interval "
        f"(`before → after` for held-out metrics; {start_sentence(results)}).",
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; commit {commit}; {date}; {hours:.2f} h of "
        "training in all (the MLflow runs' wall times, summed).",
        "",
        *metrics_table(results),
        "",
    ]
    if failed:
        lines += ["Failed runs: " + ", ".join(failed), ""]
    lines += [
        "## Paired differences against GRPO",
        "",
        "Each preset minus the GRPO run of the same seed with the same K (`grpo` for K = 1, `grpo-real-baseline` for "
        "K = 4; `grpo-tir-baseline` for `grpo-tir`, on its task): mean ± 95% interval over seeds. An interval that "
        "contains 0 is no evidence either way at this budget.",
        "",
        *differences_table(results),
        "",
        "## The papers' claims at this scale",
        "",
        "`reproduced`: the paired difference's 95% interval lies entirely on the claimed side of 0; `contradicted`: "
        f"entirely on the other side. A claim of equality is reproduced when the interval lies within ±{EQUAL_MARGIN}, "
        "contradicted when it excludes 0. A 1.1M-parameter model on arithmetic with 40-token answers is far from the papers' "
        "1.5B–32B models on competition math: a claim not reproduced here is not refuted there.",
        "",
        *claims_table(results),
        "",
    ]
    lines += [f"![{p.stem}]({figures.name}/{p.name})" for p in images]
    args.out.write_text("\n".join(lines) + "\n")
    if args.readme:
        header = (
            f"Generated by `{command}` on {date} at commit {commit}: {args.rollout_batches} rollout batches, "
            f"mean ± 95% interval over the seeds of {seeds} that finished, held-out metrics before → after."
        )
        update_readme(args.readme, readme_table(results, args.out, header))
    return args.out
