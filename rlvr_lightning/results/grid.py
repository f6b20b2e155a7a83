"""The grid of `make results`: each (preset, seed) run's name and budget, training one in its own process
(exactly `make train` with the seed set), and the MLflow run that is the parent of the runs one invocation trains."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rlvr_lightning.errors import ConfigError


def steps_per_rollout_batch(preset: Path) -> int:
    """Optimizer steps a preset takes per rollout batch: K of its algorithm as the preset configures it (what it
    leaves unset, its class's default: GSPO's and REAL's K is 4)."""
    from rlvr_lightning.training.settings import StepSettings

    model = (yaml.safe_load(preset.read_text()) or {}).get("model")
    if not model:
        raise ConfigError(f"{preset}: a preset names its algorithm (model.class_path)")
    return StepSettings.of_config(model).optimizer_steps_per_rollout_batch


def preset_model(preset: Path, args: argparse.Namespace) -> str:
    """The warm start a preset's runs begin from: `--model` when given, else the preset's own
    `data.model_name_or_path` (`grpo-tir`'s `embedded-tir`), else `configs/base.yaml`'s."""
    if args.model:
        return args.model
    for config in (preset, args.configs / "base.yaml"):
        data = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
        if data.get("model_name_or_path"):
            return str(data["model_name_or_path"])
    return "embedded"


def preset_start(preset: Path, args: argparse.Namespace) -> tuple[str, str | None]:
    """(model, the digest of its warm start's weights) a preset's runs begin from now: a run recorded from other
    weights of the same name (a warm start built before the CPU kernels were pinned) is not one of its runs. None:
    a model that is no embedded warm start, or one not known without building it (then any run of it counts)."""
    from rlvr_lightning.models.warm_start import warm_start_digest

    model = preset_model(preset, args)
    return model, warm_start_digest(model, build=False)


def run_name(preset: str, seed: int) -> str:
    return f"{preset}-seed{seed}"


def train(preset: Path, seed: int, args: argparse.Namespace) -> tuple[int, float]:
    name = run_name(preset.stem, seed)
    cmd = [
        sys.executable, "-m", "rlvr_lightning", "fit", "--config", str(args.configs / "base.yaml"), "--config", str(preset),
        f"--rollout_batches={args.rollout_batches}",
        f"--seed_everything={seed}", f"--data.seed={seed}", f"--data.val_size={args.val_size}",
        f"--data.model_name_or_path={preset_model(preset, args)}",
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


def open_comparison_run(args: argparse.Namespace):
    """(client, run id) of a new `results` run in the experiment: the parent of the runs this invocation
    trains, and the holder of the page and its figures."""
    import mlflow

    from rlvr_lightning.tracking import ensure_experiment

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    experiment_id = ensure_experiment(client, args.experiment)
    run = client.create_run(
        experiment_id,
        run_name="results",
        tags={"model": args.model or "each preset's own", "command": " ".join(args.argv)},
    )
    return client, run.info.run_id
