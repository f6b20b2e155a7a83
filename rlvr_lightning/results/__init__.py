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
import sys
from pathlib import Path

from rlvr_lightning.results.grid import open_comparison_run, preset_start, run_name, steps_per_rollout_batch, train
from rlvr_lightning.results.page import write_page
from rlvr_lightning.results.records import finished_before, finished_runs, record_finished_runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=Path, default=Path("configs"))
    p.add_argument("--algos", nargs="*", help="presets (default: every configs/algo/*.yaml)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 … N−1 per preset")
    p.add_argument("--rollout-batches", type=int, default=60)
    p.add_argument("--val-size", type=int, default=200)
    p.add_argument(
        "--model",
        help="data.model_name_or_path of every run (e.g. embedded-balanced; default: each preset's own, `embedded` "
        "unless it names another)",
    )
    p.add_argument("--experiment", default="results")
    p.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    p.add_argument("--out", type=Path, default=Path("docs/RESULTS.md"))
    p.add_argument("--log-dir", type=Path, default=Path("reports/results"))
    p.add_argument("--skip-training", action="store_true", help="only rebuild the page from the MLflow store")
    p.add_argument(
        "--readme", type=Path, help="also rewrite this README's figures block (`make results` passes README.md)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the runs this experiment already finished with the same budget and model "
        "(an interrupted `make results` goes on where it stopped)",
    )
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
                budget = str(args.rollout_batches * steps_per_rollout_batch(preset))
                if finished_before(done, name, budget, *preset_start(preset, args)):
                    print(f"[results] {name}: finished before, with this budget and warm start (--resume)", flush=True)
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
