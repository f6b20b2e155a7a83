"""Step 5: short RL runs through the real command line (`python -m rlvr_lightning fit --config configs/base.yaml
--config configs/algo/<preset>.yaml …`) with `rollout.engine hf`: GRPO, REAL, THR, OAR-G and a LoRA GRPO
policy, a few rollout batches each, each in its own process with a timeout. They must finish with finite
metrics; each run's last logged value of every train/ and val/ metric is recorded.

The GPU machine has no MLflow: the runs log through Lightning's CSVLogger. The policy is the embedded default
(its warm start is carried in `.whl/rlvr_cache/` by scripts/fetch_gpu_wheels.py when present, else built here);
with tiny shapes, the embedded architecture with random weights (a warm start takes minutes on a CPU), and only
the runs of TINY_RUNS."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.gpu_check.record import REPO

RUNS = {  # name → (preset, extra flags)
    "grpo": ("grpo", []),
    "real": ("real", []),
    "thr": ("thr", []),
    "oar-g": ("oar-g", []),
    "grpo-lora": ("grpo", ["--model.init_args.lora.rank", "16", "--model.init_args.optim.lr", "3e-4"]),
}
# With tiny shapes (the CPU test of this step) a run is mostly its process's start-up, and what the test checks is
# that the command works without the GPU machine's missing packages: one run does that, GRPO's with LoRA (the grpo
# preset, an adapter). REAL, THR and OAR-G through the CLI are tests/e2e/test_presets.py's; the GPU machine still
# runs all five.
TINY_RUNS = ("grpo-lora",)
# batch_size: a multiple of REAL's 4 mini-batches.
FULL = {"rollout_batches": 3, "batch_size": 16, "group_size": 8, "max_response_length": 40, "val_size": 64}
TINY = {"rollout_batches": 1, "batch_size": 4, "group_size": 4, "max_response_length": 8, "val_size": 4}
# Metrics that must be finite in every run (a run may lack one, e.g. REAL has no advantages).
REQUIRED = ("train/loss", "train/reward_mean", "train/grad_norm", "train/entropy")
RUN_TIMEOUT_S = 150.0  # one run's limit, so that one hung run leaves time for the others
CARRIED_CACHE = REPO / ".whl" / "rlvr_cache"


def policy(ctx) -> tuple[str, str]:
    """(data.model_name_or_path, where it came from)."""
    if ctx.tiny:
        from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, build_tiny_qwen2, save_policy

        tok = build_char_tokenizer()
        path = save_policy(build_tiny_qwen2(tok, TinyQwen2Spec(), seed=0), tok, ctx.workdir / "tiny_policy")
        return str(path), "the embedded architecture, random weights (tiny shapes)"
    cache = ctx.workdir / "rlvr_cache"
    os.environ["RLVR_CACHE_DIR"] = str(cache)
    carried = CARRIED_CACHE.is_dir() and any(CARRIED_CACHE.glob("embedded-*/warm_start.json"))
    if carried:
        shutil.copytree(CARRIED_CACHE, cache, dirs_exist_ok=True)
    from rlvr_lightning.models.warm_start import embedded_policy_path

    t0 = time.perf_counter()
    path = embedded_policy_path()
    how = "carried warm start" if carried else f"warm start built here in {time.perf_counter() - t0:.0f} s"
    return "embedded", f"the embedded default ({how}: {path.name})"


def command(preset: str, extra: list[str], sizes: dict, model: str, workdir: Path) -> list[str]:
    config = REPO / "configs" / "algo" / f"{preset}.yaml"
    return [
        sys.executable, "-m", "rlvr_lightning", "fit", "--config", str(REPO / "configs/base.yaml"), "--config", str(config),
        "--rollout.engine", "hf", "--data.model_name_or_path", model,
        "--rollout_batches", str(sizes["rollout_batches"]),
        "--data.batch_size", str(sizes["batch_size"]), "--rollout.group_size", str(sizes["group_size"]),
        "--rollout.max_response_length", str(sizes["max_response_length"]), "--data.val_size", str(sizes["val_size"]),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(workdir / "csv"),
        "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


def last_values(metrics_csv: Path) -> dict[str, float]:
    """Each column's last logged value (CSVLogger writes one row per step, empty where a metric was not logged)."""
    out: dict[str, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            out |= {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
    return out


def one_run(name: str, cmd: list[str], workdir: Path, timeout_s: float, threads: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-1500:]
        return {"error": f"timed out after {timeout_s:.0f} s", "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}", "seconds": seconds, "stderr_tail": proc.stderr[-1500:]}
    logs = sorted((workdir / "csv").glob("**/metrics.csv"))
    if not logs:
        return {"error": "no metrics.csv written", "seconds": seconds, "stderr_tail": proc.stderr[-1500:]}
    metrics = last_values(logs[-1])
    missing = [k for k in REQUIRED if k in metrics and not math.isfinite(metrics[k])]
    out = {"seconds": seconds, "final_metrics": {k: v for k, v in metrics.items() if k.startswith(("train/", "val/"))}}
    if missing or "train/loss" not in metrics:
        out["error"] = f"non-finite or missing metrics: {missing or ['train/loss']}"
    unplanned = [line for line in proc.stderr.splitlines() if "could not plan this run" in line]
    if unplanned:  # the run trained, without its memory check: a library the planner needs is missing here
        out["error"] = unplanned[0].strip()
    print(f"gpu-check:   {name}: {seconds:.0f} s, loss {metrics.get('train/loss')}, reward {metrics.get('train/reward_mean')}", flush=True)
    return out


def run(ctx) -> dict:
    sizes = TINY if ctx.tiny else FULL
    runs = {name: RUNS[name] for name in TINY_RUNS} if ctx.tiny else RUNS
    model, source = policy(ctx)
    # On the GPU machine (16 cores) the runs go side by side; on a small CPU one at a time.
    parallel = len(runs) if torch.cuda.is_available() and (os.cpu_count() or 1) >= 2 * len(runs) else 1
    threads = max(1, (os.cpu_count() or 1) // parallel)
    results: dict = {"policy": source, "sizes": sizes, "parallel": parallel, "runs": {}}

    def launch(item):
        name, (preset, extra) = item
        workdir = ctx.workdir / "rl_runs" / name
        if ctx.deadline.spent(reserve=10):
            return name, {"skipped": "the step's time budget is spent"}
        return name, one_run(name, command(preset, extra, sizes, model, workdir), workdir,
                           min(RUN_TIMEOUT_S, ctx.deadline.left - 5), threads)  # fmt: skip

    with ThreadPoolExecutor(parallel) as pool:
        for name, result in pool.map(launch, runs.items()):
            results["runs"][name] = result
    return results
