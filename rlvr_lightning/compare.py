"""Side-by-side comparison of training runs from the MLflow store: a Markdown table and PNG plots
(training accuracy and held-out accuracy against the rollout batch, one line per run), written to a folder and
logged back to MLflow as the artifacts of a `compare` run.

    python -m rlvr_lightning.compare [--runs grpo thr oar-g] [--out reports/compare]
    make compare RUNS="grpo thr oar-g"

Runs are chosen by run name (the latest finished run of each name) or by run id; by default the
latest finished run of every name in the experiment. A run with other pieces than its preset's has a name
of its own (`grpo+policy_loss=my_loss`, see `rlvr_lightning.cli.run_naming.run_identity`), so it is never taken for
the preset's run.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

TABLE_METRICS = [  # (column, metric key, how to summarise its history)
    ("val/accuracy", "val/accuracy", "first_last"),
    ("greedy", "val/accuracy_greedy", "first_last"),
    ("pass@4", "val/pass_at_4", "first_last"),
    ("pass@8", "val/pass_at_8", "first_last"),
    ("train accuracy (last 10)", "train/accuracy", "tail_mean"),  # rewards differ in scale (DAPO: ±1)
    ("s / step", "time/step", "mean"),
    ("attribution s", "time/attribution", "mean"),
]
PLOTS = [("train_accuracy", "train/accuracy", 10), ("val_accuracy", "val/accuracy", 1), ("val_accuracy_greedy", "val/accuracy_greedy", 1)]


@dataclass
class RunHistory:
    name: str
    run_id: str
    status: str
    algorithm: str
    history: dict[str, list[tuple[int, float]]]  # metric → [(step, value)] sorted by step
    seconds: float = math.nan  # the MLflow run's wall time, start to end
    commit: str | None = None  # the code's git commit, as the run's summary tagged it
    warm_start: str | None = None  # the embedded warm start's weights digest the run began from (its tag)


def select_runs(client, experiment_id: str, wanted: list[str] | None) -> list:
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time DESC"], max_results=5000)
    by_name: dict[str, object] = {}
    for run in runs:  # newest first: keep the latest finished run of each name
        if run.info.status == "FINISHED" and run.info.run_name != "compare":
            by_name.setdefault(run.info.run_name, run)
    if not wanted:
        return sorted(by_name.values(), key=lambda r: r.info.run_name)
    chosen = []
    for key in wanted:
        run = by_name.get(key) or next((r for r in runs if r.info.run_id == key), None)
        if run is None:
            valid = ", ".join(sorted(by_name)) or "none"
            raise SystemExit(f"error: no finished run named or with id {key!r}; finished runs: {valid}")
        chosen.append(run)
    return chosen


def load_history(client, run, columns=TABLE_METRICS) -> RunHistory:
    keys = {key for _, key, _ in columns} | {key for _, key, _ in PLOTS}
    history = {}
    for key in keys:
        points = client.get_metric_history(run.info.run_id, key)
        history[key] = sorted((m.step, m.value) for m in points)
    # The module class, then what the run changed from its preset's and the parts it has (the CLI's `changes` and
    # `parts` tags, `run_naming.run_identity`): `GRPO+policy_loss=gspo+reward=boxed_bonus+shaper=thr`.
    tags = run.data.tags
    labels = [c for key in ("changes", "parts") for c in tags.get(key, "").split("+") if c]
    algorithm = "+".join([tags.get("algorithm", "?"), *dict.fromkeys(labels)])
    seconds = (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else math.nan
    commit, warm_start = run.data.tags.get("git_commit"), run.data.tags.get("warm_start_sha256")
    return RunHistory(run.info.run_name, run.info.run_id, run.info.status, algorithm, history, seconds, commit, warm_start)


def summary(points: list[tuple[int, float]], how: str) -> float | None:
    """One number for a metric's history: its `last` value, the mean of the last 10 (`tail_mean`) or of
    all (`mean`); None for an empty history."""
    values = [v for _, v in points]
    if not values:
        return None
    if how == "last":
        return values[-1]
    return statistics.fmean(values[-10:] if how == "tail_mean" else values)


def summarise(points: list[tuple[int, float]], how: str) -> str:
    if not points:
        return "–"
    if how == "first_last":
        return f"{points[0][1]:.3f} → {points[-1][1]:.3f}"
    if how == "sum_minutes":
        return f"{sum(v for _, v in points) / 60:.1f}"
    return f"{summary(points, how):.3f}"


def markdown_table(runs: list[RunHistory], columns=TABLE_METRICS) -> str:
    header = ["run", "algorithm", "steps", *[col for col, _, _ in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in runs:
        steps = max((s for s, _ in r.history.get("train/accuracy", [])), default=-1) + 1
        cells = [r.name, r.algorithm, str(steps), *[summarise(r.history[key], how) for _, key, how in columns]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[RunHistory], key: str, title: str, smooth: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.2), dpi=120)
    colors = plt.get_cmap("tab20").colors if len(runs) > 10 else plt.get_cmap("tab10").colors
    for i, r in enumerate(runs):
        points = r.history.get(key, [])
        if not points:
            continue
        steps, values = zip(*points)
        if smooth > 1:  # trailing moving average: per-step rewards are noisy
            values = [statistics.mean(values[max(0, j - smooth + 1) : j + 1]) for j in range(len(values))]
        # Distinct colour and dash per run, so a dozen runs (and runs that coincide) stay readable.
        ax.plot(
            steps,
            values,
            label=r.name,
            marker="o" if len(points) < 20 else None,
            color=colors[i % len(colors)],
            linestyle=("-", "--", ":", "-.")[i % 4],
        )
    ax.set_xlabel("rollout batch")
    ax.set_ylabel(key + (f" (moving average of {smooth})" if smooth > 1 else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # outside: never over the lines
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def compare(tracking_uri: str, experiment: str, wanted: list[str] | None, out: Path, log_to_mlflow: bool = True) -> Path:
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"error: no MLflow experiment {experiment!r} in {tracking_uri}")
    runs = [load_history(client, r) for r in select_runs(client, exp.experiment_id, wanted)]
    if not runs:
        raise SystemExit(f"error: experiment {experiment!r} has no finished runs")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(runs)
    files = [out / "compare.md"]
    files[0].write_text(f"# Run comparison ({experiment})\n\n{table}\nRuns: " + ", ".join(f"{r.name} `{r.run_id}`" for r in runs) + "\n")
    for name, key, smooth in PLOTS:
        if not any(r.history.get(key) for r in runs):
            continue
        files.append(plot(runs, key, f"{key} vs rollout batch", smooth, out / f"{name}.png"))
    if log_to_mlflow:
        # Linked, not nested: a run may be in many comparisons but has one parent. The description (the
        # run's Overview) is the comparison's table with each compared run's id.
        tags = {"compared_runs": ",".join(r.run_id for r in runs), "mlflow.note.content": files[0].read_text()}
        run = client.create_run(exp.experiment_id, run_name="compare", tags=tags)
        for f in files:
            client.log_artifact(run.info.run_id, str(f))
        client.set_terminated(run.info.run_id)
    print(table)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--experiment", default="rlvr_lightning")
    parser.add_argument("--runs", nargs="*", help="run names or ids (default: latest finished run of each name)")
    parser.add_argument("--out", default="reports/compare")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log the report back to MLflow")
    args = parser.parse_args(argv)
    compare(args.tracking_uri, args.experiment, args.runs, Path(args.out), log_to_mlflow=not args.no_mlflow)


if __name__ == "__main__":
    main()
