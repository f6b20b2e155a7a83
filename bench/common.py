"""Shared set-up for the benchmarks: the embedded default workload through the real module code."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _instantiate(spec: dict):
    import importlib

    module_name, cls = spec["class_path"].rsplit(".", 1)
    return getattr(importlib.import_module(module_name), cls)(**(spec.get("init_args") or {}))


def preset(name: str):
    """(module, extra callbacks) exactly as `configs/algo/<name>.yaml` builds them for `make train`."""
    import yaml

    cfg = yaml.safe_load((CONFIGS / "algo" / f"{name}.yaml").read_text())
    callbacks = [_instantiate(c) for c in (cfg.get("trainer") or {}).get("callbacks+", [])]
    return _instantiate(cfg["model"]), callbacks


def embedded_module(module, callbacks=(), batch_size: int = 16, seed: int = 0, logger=False, **rollout_options):
    """`module` wired to the embedded default data/model (configs/base.yaml's sizes) outside `fit`, with `logger`;
    `rollout_options`: `RolloutSettings` arguments over base.yaml's."""
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.standalone import standalone

    rollout = RolloutSettings(**{"group_size": 8, "max_response_length": 40, **rollout_options})
    dm = RolloutDataModule(batch_size=batch_size, max_prompt_length=32, seed=seed, val_data=None, rollout=rollout)
    torch.manual_seed(seed)
    return standalone(module, dm, callbacks=[*callbacks], logger=logger)


def close(module) -> None:
    for cb in module.trainer.callbacks:
        cb.teardown(module.trainer, module, "fit")
    module.teardown("fit")  # closes the engine
    module.trainer.datamodule.teardown("fit")


def prompt_batches(module):
    while True:
        yield from module.trainer.datamodule.train_dataloader()


def timed_steps(module, steps: int, warmup: int = 1) -> list[tuple]:
    """`warmup` + `steps` real training steps; the `StepResult`s of the timed ones.
    Closes the module's engine and verifier."""
    from rlvr_lightning.training.step_metrics import StepResult

    batches = prompt_batches(module)
    results = []
    for i in range(warmup + steps):
        result = module.train_on_batch(next(batches))
        module.rollout_batches += 1
        if isinstance(result, StepResult) and i >= warmup:  # not a skipped batch
            results.append(result)
    close(module)
    return results


def peak_rss_mib() -> float:
    """Peak resident memory of this process (vLLM runs in-process, so engine included), MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(script: str, *args: str, tail: int = 3000) -> tuple[dict | None, str]:
    """Run `script --one … --out <file>` in a fresh Python process (a fresh allocator, engine and
    thread pool per measurement): the JSON it wrote, or None and the tail of its stderr if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, script, *args, "--out", out.name], capture_output=True, text=True)
        if proc.returncode != 0:
            return None, proc.stderr[-tail:]
        return json.loads(Path(out.name).read_text()), ""


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},  # fmt: skip
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload, indent=2))
    log_to_mlflow(name, payload, path)
    return path


def _numeric_leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _numeric_leaves(value, f"{prefix}{key}/")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield prefix.rstrip("/"), float(tree)


def log_to_mlflow(name: str, payload: dict, path: Path) -> None:
    """The result as an MLflow run of the `bench` experiment: every number a metric, the JSON an artifact.
    Set RLVR_BENCH_MLFLOW=0 to skip (the JSON file is the record either way)."""
    if os.environ.get("RLVR_BENCH_MLFLOW", "1") == "0":
        return
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=os.environ.get("RLVR_BENCH_TRACKING_URI", "sqlite:///mlruns/mlflow.db"))
    exp = client.get_experiment_by_name("bench")
    exp_id = exp.experiment_id if exp else client.create_experiment("bench", artifact_location="mlruns/artifacts")
    run = client.create_run(exp_id, run_name=name)
    for key, value in _numeric_leaves({k: v for k, v in payload.items() if k != "machine"}):
        client.log_metric(run.info.run_id, re.sub(r"[^\w\-. /]", "_", key)[:250], value)
    client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id)
