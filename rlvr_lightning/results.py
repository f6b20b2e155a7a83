"""Regenerate `docs/RESULTS.md`: train every preset on the embedded default over several seeds at the same
budget, then report each metric's mean with a 95% interval over seeds, each preset's paired difference
against the GRPO run of the same seed and the same optimizer-step structure, and which claims of the
source papers this scale reproduces.

    python -m rlvr_lightning.results [--algos grpo thr] [--seeds 3] [--rollout-batches 60]
    make results

Each (preset, seed) runs in its own process (`python -m rlvr_lightning fit`, exactly `make train` with
`--seed_everything` and `--data.seed` set) in the MLflow experiment `results`, named `<preset>-seed<k>`,
so a run that fails is reported and the others still run. The budget is counted in rollout batches
(`--rollout_batches`): a preset taking K optimizer steps per batch (DAPO, GSPO, REAL and the REAL tables'
baselines) logs K × rollout_batches `trainer.max_steps`, so every preset sees the same prompts and samples for
a seed.
Paired differences compare a preset with `grpo` (K = 1) or `grpo-real-baseline` (K = 4) at the same
seed: the same warm start, prompts order and held-out problems, so seed-to-seed noise largely cancels.

Each finished run is also written as a run record (`docs/results/runs/<run>.json`, `rlvr_lightning/run_records.py`)
and the page is built from those: commit them with the page, and `--resume` or `--skip-training` works
from a fresh clone without the MLflow store.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlvr_lightning.compare import PLOTS, RunHistory, plot, summary
from rlvr_lightning.run_records import RunRecord, read_records, record_from_mlflow, write_record

METRICS = [  # (column, metric key, summary of one run's history: the final value or the mean of the last 10)
    ("val/accuracy", "val/accuracy", "last"),
    ("greedy", "val/accuracy_greedy", "last"),
    ("pass@4", "val/pass_at_4", "last"),
    ("pass@8", "val/pass_at_8", "last"),
    ("maj@8", "val/maj_at_8", "last"),
    ("train accuracy (last 10)", "train/accuracy", "tail_mean"),
    ("entropy (last 10)", "train/entropy", "tail_mean"),
    ("s / rollout batch", "time/step", "mean"),
]
BASELINES = {1: "grpo", 4: "grpo-real-baseline"}  # the GRPO run with the same optimizer steps per rollout batch
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
]


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of the Student-t interval) of `values`; the half-width is nan for one value."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, float(t.ppf(0.5 + level / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


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


def fmt(mean: float, half: float) -> str:
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def steps_per_rollout_batch(preset: Path) -> int:
    """Optimizer steps a preset takes per rollout batch (num_mini_batches × ppo_epochs, default 1 × 1)."""
    model = (yaml.safe_load(preset.read_text()) or {}).get("model", {}).get("init_args", {})
    return int(model.get("num_mini_batches", 1)) * int(model.get("ppo_epochs", 1))


def run_name(preset: str, seed: int) -> str:
    return f"{preset}-seed{seed}"


def train(preset: Path, seed: int, args: argparse.Namespace) -> tuple[int, float]:
    name = run_name(preset.stem, seed)
    cmd = [
        sys.executable, "-m", "rlvr_lightning", "fit", "--config", str(args.configs / "base.yaml"), "--config", str(preset),
        f"--rollout_batches={args.rollout_batches}",
        f"--seed_everything={seed}", f"--data.seed={seed}", f"--data.val_size={args.val_size}",
        f"--data.model_name_or_path={args.model}",
        f"--trainer.logger.init_args.experiment_name={args.experiment}",
        f"--trainer.logger.init_args.tracking_uri={args.tracking_uri}", f"--trainer.logger.init_args.run_name={name}",
        "--trainer.enable_progress_bar=false",
        # A child of this comparison's run: the MLflow UI nests the runs under it.
        "--trainer.logger.init_args.tags=" + json.dumps({"mlflow.parentRunId": args.parent_run_id}),
    ]  # fmt: skip
    t0 = time.perf_counter()
    with open(args.log_dir / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    return rc, time.perf_counter() - t0


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


def same_start(a: RunHistory, b: RunHistory) -> bool:
    """Whether two runs began from the same weights and held-out evaluation: the same warm-start digest where
    both runs tagged one, and equal step-0 greedy accuracies. That accuracy depends on no seed, so it differs
    only where the weights, the verifier or the evaluation did (runs on another build of the warm start, say);
    such runs are not paired. Runs without either cannot tell."""
    if a.warm_start and b.warm_start and a.warm_start != b.warm_start:
        return False
    first_a, first_b = a.history.get(START_KEY, [])[:1], b.history.get(START_KEY, [])[:1]
    return not first_a or not first_b or list(first_a[0]) == list(first_b[0])


def unpaired_seeds(preset: PresetRuns, baseline: PresetRuns) -> list[int]:
    """The seeds both finished whose runs began from different evaluations (`same_start`)."""
    both = sorted(preset.runs.keys() & baseline.runs.keys())
    return [s for s in both if not same_start(preset.runs[s], baseline.runs[s])]


def paired_difference(preset: PresetRuns, baseline: PresetRuns, key: str, how: str) -> tuple[float, float, int]:
    """(mean, 95% half-width, seeds) of preset − baseline over the seeds both finished from the same start."""
    a, b = preset.values(key, how), baseline.values(key, how)
    skip = set(unpaired_seeds(preset, baseline))
    diffs = [a[s] - b[s] for s in sorted(a.keys() & b.keys()) if s not in skip]
    if not diffs:
        return math.nan, math.nan, 0
    return (*t_interval(diffs), len(diffs))


def load_presets(records: dict[str, RunRecord], presets: list[Path], args: argparse.Namespace) -> dict[str, PresetRuns]:
    """Every (preset, seed)'s recorded run at this invocation's budget and model."""
    out = {}
    for preset in presets:
        budget = args.rollout_batches * steps_per_rollout_batch(preset)
        runs = {s: rec.run for s in args.seed_list
                if (rec := records.get(run_name(preset.stem, s))) and rec.matches(budget, args.model)}  # fmt: skip
        if runs:
            out[preset.stem] = PresetRuns(preset.stem, steps_per_rollout_batch(preset), runs)
    return out


def records_dir(args: argparse.Namespace) -> Path:
    """docs/RESULTS.md → docs/results/runs: the page's records beside its figures."""
    return args.out.parent / args.out.stem.lower() / "runs"


def record_finished_runs(args: argparse.Namespace, names: set[str]) -> None:
    """Write the record of the latest finished MLflow run of each of `names` that is newer than its record."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    if exp is None:
        return
    records = read_records(records_dir(args))
    latest: dict[str, object] = {}
    for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=5000):
        if run.info.status == "FINISHED" and run.info.run_name in names:
            latest.setdefault(run.info.run_name, run)
    for name, run in latest.items():
        if name not in records or records[name].start_time < run.info.start_time:
            write_record(record_from_mlflow(client, run, METRICS), records_dir(args))


def metric_cell(pr: PresetRuns, key: str, how: str) -> str:
    """Mean ± 95% half-width over seeds; held-out metrics (`last`) as `before → after`."""
    values = list(pr.values(key, how).values())
    cell = fmt(*t_interval(values)) if values else "–"
    before = pr.before(key) if how == "last" else None
    return cell if before is None else f"{before:.3f} → {cell}"


def metrics_table(results: dict[str, PresetRuns]) -> list[str]:
    header = ["preset", "algorithm", "K", "seeds", *[col for col, _, _ in METRICS]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, pr in results.items():
        cells = [name, next(iter(pr.runs.values())).algorithm, str(pr.steps_per_batch), str(len(pr.runs))]
        cells += [metric_cell(pr, key, how) for _, key, how in METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def differences_table(results: dict[str, PresetRuns]) -> list[str]:
    columns = [m for m in METRICS if m[2] != "mean"]  # time is not paired noise; it is in the table above
    header = ["preset", "baseline", *[f"Δ {col}" for col, _, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    unpaired = []
    for name, pr in results.items():
        base = BASELINES.get(pr.steps_per_batch)
        if base is None or base == name or base not in results:
            continue
        cells = [name, base]
        for _, key, how in columns:
            mean, half, n = paired_difference(pr, results[base], key, how)
            cells.append("–" if n == 0 else fmt(mean, half))
        lines.append("| " + " | ".join(cells) + " |")
        if seeds := unpaired_seeds(pr, results[base]):
            unpaired.append(f"`{name}` seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}")
    if unpaired:
        lines += ["", "Not paired, their baseline's run having begun from other weights or another held-out evaluation "
                  "(another warm-start digest, or another step-0 greedy accuracy: another verifier or evaluation; rerun "
                  "both at one commit on one warm start): "
                  + "; ".join(unpaired) + "."]  # fmt: skip
    return lines


def claims_table(results: dict[str, PresetRuns]) -> list[str]:
    lines = ["| claim | preset − baseline | metric | difference (95% interval) | seeds | at this scale |", "|---|---|---|---|---|---|"]
    by_column = {col: (key, how) for col, key, how in METRICS}
    for claim, preset, column, direction, *baseline in CLAIMS:
        pr = results.get(preset)
        base = baseline[0] if baseline else BASELINES.get(pr.steps_per_batch) if pr else None
        if pr is None or base not in results:
            lines.append(f"| {claim} | {preset} − {base or 'its baseline'} | {column} | – | 0 | not run |")
            continue
        mean, half, n = paired_difference(pr, results[base], *by_column[column])
        if n == 0:
            why = "not comparable (the runs began from different starts)" if unpaired_seeds(pr, results[base]) else "no seed in common"  # fmt: skip
            lines.append(f"| {claim} | {preset} − {base} | {column} | – | 0 | {why} |")
            continue
        lines.append(f"| {claim} | {preset} − {base} | {column} | {fmt(mean, half)} | {n} | {verdict(mean, half, direction)} |")
    return lines


README_BEGIN, README_END = "<!-- make results: begin -->", "<!-- make results: end -->"
README_COLUMNS = ["val/accuracy", "greedy", "pass@4", "pass@8"]  # times: the page (runs may share a machine)


def readme_table(results: dict[str, PresetRuns], page: Path, header: str) -> list[str]:
    """The README's figures: a few columns of the results page, with where and when they come from."""
    by_column = {col: (key, how) for col, key, how in METRICS}
    lines = [header, "", "| `make train ALGO=` | K | seeds | " + " | ".join(README_COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(README_COLUMNS)]  # fmt: skip
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


def write_page(args: argparse.Namespace, presets: list[Path], outcomes: dict[str, tuple[int, float]]) -> Path:
    results = load_presets(read_records(records_dir(args)), presets, args)
    figures = args.out.parent / args.out.stem.lower()  # docs/RESULTS.md → docs/results/: one folder per page
    figures.mkdir(parents=True, exist_ok=True)
    curves = [pr.mean_history() for pr in results.values()]
    images = [plot(curves, key, f"{key} vs rollout batch, mean of seeds", smooth, figures / f"{name}.png")
              for name, key, smooth in PLOTS if any(c.history.get(key) for c in curves)]  # fmt: skip
    # The runs' own commits (a resumed `make results` may mix several), not this checkout's.
    commits = Counter(r.commit or "not recorded" for pr in results.values() for r in pr.runs.values())
    commit = ", ".join(f"`{c}` ({n} run{'s' * (n != 1)})" if len(commits) > 1 else f"`{c}`" for c, n in commits.most_common())
    failed = [f"`{n}` (exit {rc}, log `{args.log_dir / n}.log`)" for n, (rc, _) in outcomes.items() if rc != 0]
    seeds = " ".join(map(str, args.seed_list))
    date = time.strftime("%Y-%m-%d", time.gmtime())
    command = " ".join(["python -m rlvr_lightning.results", *(a for a in args.argv if a not in ("--skip-training", "--resume"))])
    command = command.replace(f" --readme {args.readme}", "") if args.readme else command
    hours = sum(r.seconds for pr in results.values() for r in pr.runs.values() if not math.isnan(r.seconds)) / 3600
    lines = [
        f"# Results: {'every preset' if args.algos is None else ', '.join(args.algos)} on `{args.model}`, over seeds",
        "",
        f"Generated by `{command}` (`make results ARGS='…'`); do not edit by hand.",
        "",
        f"- Workload: the embedded tiny Qwen2 policy, warm-started as `{args.model}`, on the embedded arithmetic task, {args.rollout_batches} "
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
        "K = 4): mean ± 95% interval over seeds. An interval that contains 0 is no evidence either way at this budget.",
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
        header = (f"Generated by `{command}` on {date} at commit {commit}: {args.rollout_batches} rollout batches, "
                  f"mean ± 95% interval over the seeds of {seeds} that finished, held-out metrics before → after.")  # fmt: skip
        update_readme(args.readme, readme_table(results, args.out, header))
    return args.out


def open_comparison_run(args: argparse.Namespace):
    """(client, run id) of a new `results` run in the experiment: the parent of the runs this invocation
    trains, and the holder of the page and its figures."""
    import mlflow

    from rlvr_lightning.tracking import ensure_experiment

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    experiment_id = ensure_experiment(client, args.experiment)
    run = client.create_run(experiment_id, run_name="results", tags={"model": args.model, "command": " ".join(args.argv)})
    return client, run.info.run_id


def finished_runs(args: argparse.Namespace) -> set[tuple[str, str]]:
    """(run name, trainer.max_steps) of the runs on `args.model` that the records or the experiment hold."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    runs = client.search_runs([exp.experiment_id], max_results=5000) if exp else []
    done = {(r.info.run_name, r.data.params.get("trainer.max_steps")) for r in runs
            if r.info.status == "FINISHED" and r.data.params.get("data.model_name_or_path") == args.model}  # fmt: skip
    return done | {(name, rec.max_steps) for name, rec in read_records(records_dir(args)).items() if rec.model == args.model}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=Path, default=Path("configs"))
    p.add_argument("--algos", nargs="*", help="presets (default: every configs/algo/*.yaml)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 … N−1 per preset")
    p.add_argument("--rollout-batches", type=int, default=60)
    p.add_argument("--val-size", type=int, default=200)
    p.add_argument("--model", default="embedded", help="data.model_name_or_path of every run (e.g. embedded-balanced)")
    p.add_argument("--experiment", default="results")
    p.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    p.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    p.add_argument("--log-dir", type=Path, default=Path("reports/results"))
    p.add_argument("--skip-training", action="store_true", help="only rebuild the page from the MLflow store")
    p.add_argument("--readme", type=Path, help="also rewrite this README's figures block (`make results` passes README.md)")
    p.add_argument("--resume", action="store_true",
                   help="skip the runs this experiment already finished with the same budget and model "
                        "(an interrupted `make results` goes on where it stopped)")  # fmt: skip
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.seeds < 1:
        raise SystemExit("error: --seeds must be ≥ 1")
    args.seed_list = list(range(args.seeds))
    presets = sorted((args.configs / "algo").glob("*.yaml"))
    if args.algos:
        known = {q.stem: q for q in presets}
        unknown = [a for a in args.algos if a not in known]
        if unknown:
            raise SystemExit(f"error: unknown preset(s) {unknown}; valid: {', '.join(known)}")
        presets = [known[a] for a in args.algos]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, tuple[int, float]] = {}
    done = finished_runs(args) if args.resume else set()
    client, args.parent_run_id = open_comparison_run(args)
    if not args.skip_training:
        for seed in args.seed_list:  # seed by seed: an interrupted run still has every preset at the first seeds
            for preset in presets:
                name = run_name(preset.stem, seed)
                if (name, str(args.rollout_batches * steps_per_rollout_batch(preset))) in done:
                    print(f"[results] {name}: finished before, with this budget and model (--resume)", flush=True)
                    continue
                print(f"[results] training {name} …", flush=True)
                outcomes[name] = train(preset, seed, args)
                print(f"[results] {name}: exit {outcomes[name][0]} in {outcomes[name][1] / 60:.1f} min", flush=True)
                record_finished_runs(args, {name})  # at once: an interrupted invocation keeps what it finished
    # Runs finished in this store by an earlier invocation (or before records existed) that lack a record.
    record_finished_runs(args, {run_name(q.stem, s) for q in presets for s in args.seed_list})
    page = write_page(args, presets, outcomes)
    client.log_artifact(args.parent_run_id, str(page))
    client.log_artifacts(args.parent_run_id, str(page.parent / page.stem.lower()), page.stem.lower())
    client.set_tag(args.parent_run_id, "mlflow.note.content", page.read_text())  # the page, on its Overview
    failed = any(rc != 0 for rc, _ in outcomes.values())
    client.set_terminated(args.parent_run_id, "FAILED" if failed else "FINISHED")
    print(f"wrote {page} (MLflow run {args.parent_run_id}, experiment {args.experiment})")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
