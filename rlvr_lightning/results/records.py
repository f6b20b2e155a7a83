"""The run records of `make results` (`docs/results/runs/<run>.json`, `rlvr_lightning/run_records.py`): written
from the MLflow store as runs finish, read back to build the page and to tell which runs `--resume` can skip, so
both work from a fresh clone without the store."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlvr_lightning.results.grid import preset_start, run_name, steps_per_rollout_batch
from rlvr_lightning.results.stats import METRICS, PresetRuns
from rlvr_lightning.run_records import RunRecord, read_records, record_from_mlflow, same_weights, write_record


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


def finished_runs(args: argparse.Namespace) -> set[tuple[str, str, str, str | None]]:
    """(run name, trainer.max_steps, data.model_name_or_path, its warm start's digest) of the finished runs the
    records or the experiment hold."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    runs = client.search_runs([exp.experiment_id], max_results=5000) if exp else []
    done = {
        (r.info.run_name, r.data.params.get("trainer.max_steps"), r.data.params.get("data.model_name_or_path"),
         r.data.tags.get("warm_start_sha256"))
        for r in runs
        if r.info.status == "FINISHED"
    }  # fmt: skip
    return done | {(name, rec.max_steps, rec.model, rec.run.warm_start) for name, rec in read_records(records_dir(args)).items()}


def finished_before(done: set[tuple[str, str, str, str | None]], name: str, budget: str, model: str, digest: str | None) -> bool:
    """Whether `finished_runs` holds run `name` with this budget and model, from these weights where it knows their
    digest (as `RunRecord.matches`)."""
    return any(d[:3] == (name, budget, model) and same_weights(d[3], digest) for d in done)


def load_presets(records: dict[str, RunRecord], presets: list[Path], args: argparse.Namespace) -> dict[str, PresetRuns]:
    """Every (preset, seed)'s recorded run at this invocation's budget and model."""
    out = {}
    for preset in presets:
        budget = args.rollout_batches * steps_per_rollout_batch(preset)
        runs = {
            s: rec.run
            for s in args.seed_list
            if (rec := records.get(run_name(preset.stem, s))) and rec.matches(budget, *preset_start(preset, args))
        }
        if runs:
            out[preset.stem] = PresetRuns(preset.stem, steps_per_rollout_batch(preset), runs)
    return out
