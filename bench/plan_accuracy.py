"""The planner held against measurement on this CPU: for configurations that differ in vocabulary, response
length, micro-batch, engine and algorithm, the plan's predicted peak of the training process against the
peak RSS of a real run, and the plan's trainer tensors against PyTorch's own accounting of a real step.

Each configuration is `make train`'s own command line (configs/base.yaml + a preset + flags) on the
random-init synthetic Qwen2 of `rlvr_lightning.models.synthetic` (hidden 256, 2 layers) at a 1,024- or
151,936-token vocabulary, 4 prompts × G = 8, no held-out evaluation, two rollout batches:
  - plan: `python -m rlvr_lightning.plan <the same flags> --hardware cpu --json …` (a fresh process);
  - measured: `python -m rlvr_lightning fit <the same flags> --plan.check false`, its own resident memory
    polled every 50 ms (the training process: trainer, in-process vLLM engine, libraries; the verifier's
    worker processes are separate and not part of the plan);
  - trainer tensors: `planner.measure.real_step_peak_bytes` (PyTorch's MemTracker on a real step at the
    plan's worst-case micro-batch) against the planner's figure for the same step (without the KL
    reference, which MemTracker cannot run; the RSS comparison includes it).
An untrained model rarely samples EOS, so responses run to the limit: the plan's worst case is the run.
The engine probe measures what the planner's CPU engine constants come from: the resident memory an
in-process vLLM engine adds at start-up, beyond its weights and KV cache, at both vocabularies.

    .venv/bin/python bench/plan_accuracy.py [--configs v1k-t256-mb4-vllm-grpo,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
CONFIGS = {  # name → (vocabulary, response tokens, micro-batch, engine, preset)
    "v1k-t256-mb4-vllm-grpo": (1024, 256, 4, "vllm", "grpo"),
    "v152k-t256-mb4-vllm-grpo": (151_936, 256, 4, "vllm", "grpo"),
    "v152k-t1024-mb8-vllm-grpo": (151_936, 1024, 8, "vllm", "grpo"),
    "v1k-t1024-mb8-hf-grpo": (1024, 1024, 8, "hf", "grpo"),
    "v152k-t256-mb8-vllm-real": (151_936, 256, 8, "vllm", "real"),
    "v152k-t256-mb4-vllm-thr": (151_936, 256, 4, "vllm", "thr"),
    "v1k-t256-mb4-hf-thr": (1024, 256, 4, "hf", "thr"),
}


def model_dir(vocab: int) -> str:
    from rlvr_lightning.models.synthetic import SyntheticQwen2Spec, synthetic_policy_path

    return str(synthetic_policy_path(SyntheticQwen2Spec(vocab_size=vocab)))


def flags(name: str, workdir: Path) -> list[str]:
    vocab, response, micro, engine, preset = CONFIGS[name]
    return [
        "--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / f"configs/algo/{preset}.yaml"),
        "--data.model_name_or_path", model_dir(vocab), "--data.val_data", "null", "--data.batch_size", "4",
        "--rollout.group_size", "8", "--rollout.max_response_length", str(response), "--rollout.engine", engine,
        "--model.init_args.compute.micro_batch_size", str(micro), "--rollout_batches", "2",
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{workdir}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(workdir / "artifacts"),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip


def env() -> dict:
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def planned(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-m", "rlvr_lightning.plan", *args, "--hardware", "cpu", "--json", out.name],
                              capture_output=True, text=True, env=env(), cwd=REPO)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        return json.loads(Path(out.name).read_text())


def measured_rss(args: list[str], workdir: Path, extra_env: dict | None = None) -> tuple[int, float]:
    """(peak resident bytes of the training process, wall seconds)."""
    t0 = time.perf_counter()
    with open(workdir / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", "fit", *args, "--plan.check", "false"],
                                stdout=log, stderr=subprocess.STDOUT, env={**env(), **(extra_env or {})}, cwd=workdir)  # fmt: skip
        me, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                peak = max(peak, me.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError((workdir / "train.log").read_text()[-3000:])
    return peak, time.perf_counter() - t0


def trainer_tensors(args: list[str]) -> dict:
    """The planner's trainer peak and PyTorch's MemTracker on a real step, same setup, no reference."""
    from rlvr_lightning.plan import parse
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.measure import real_step_peak_bytes
    from rlvr_lightning.planner.planner import trainer_setup
    from rlvr_lightning.planner.run_spec import run_spec
    from rlvr_lightning.planner.trainer_measurement import measure_trainer

    cfg, _ = parse(args)
    setup = dataclasses.replace(trainer_setup(run_spec(cfg, hardware("cpu"))), with_reference=False)
    plan = measure_trainer(setup, with_flops=False).peak.peak_bytes
    real = real_step_peak_bytes(setup)
    return {"planned_gib": round(plan / GIB, 4), "pytorch_memtracker_gib": round(real / GIB, 4),
            "ratio": round(plan / real, 3), "within_10pct": abs(plan / real - 1) <= 0.10}  # fmt: skip


ENGINE_PROBE = """
import sys, psutil, torch, transformers, lightning, mlflow, vllm
from vllm import LLM
me = psutil.Process()
before = me.memory_info().rss
engine = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=1056, seed=0)
print("ADDED", me.memory_info().rss - before)
"""


def engine_probe(vocab: int) -> dict:
    """Resident bytes an in-process vLLM engine adds at start-up (after its import), and the part beyond its
    weights and KV cache."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_PROBE, model_dir(vocab)], capture_output=True, text=True, env=env())
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    added = int(next(line for line in proc.stdout.splitlines() if line.startswith("ADDED")).split()[1])
    weights = json.loads((Path(model_dir(vocab)) / "synthetic.json").read_text())["parameters"] * 4
    kv = float(env()["VLLM_CPU_KVCACHE_SPACE"]) * GIB
    return {"added_gib": round(added / GIB, 3), "beyond_weights_and_kv_gib": round((added - weights - kv) / GIB, 3)}


def one(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        args = flags(name, workdir)
        plan = planned(args)
        rss, wall = measured_rss(args, workdir)
        predicted = plan["peak_gib_per_rank"] * GIB
        fixed_threshold = {}
        if CONFIGS[name][3] == "hf":  # the same run with glibc's mmap threshold fixed: large blocks go back at once
            fixed, _ = measured_rss(args, workdir, {"MALLOC_MMAP_THRESHOLD_": "131072"})
            fixed_threshold = {"measured_peak_rss_gib_mmap_threshold_128k": round(fixed / GIB, 3),
                               "ratio_mmap_threshold_128k": round(predicted / fixed, 3)}  # fmt: skip
        return {
            "config": dict(zip(["vocab", "response_tokens", "micro_batch", "engine", "preset"], CONFIGS[name], strict=True)),
            "predicted_peak_gib": plan["peak_gib_per_rank"], "peak_stage": plan["peak_stage"],
            "measured_peak_rss_gib": round(rss / GIB, 3), "ratio": round(predicted / rss, 3),
            "within_20pct": abs(predicted / rss - 1) <= 0.20, "breakdown_gib": plan["breakdown"],
            "trainer_tensors": trainer_tensors(args), "train_wall_s": round(wall, 1),
            "measured_on": time.strftime("%Y-%m-%d"), **fixed_threshold,
        }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--probe-only", action="store_true", help="re-measure the engine probe into the existing JSON")
    p.add_argument("--update", action="store_true", help="re-measure --configs into the existing JSON, keeping the others")
    args = p.parse_args()
    path = Path(__file__).resolve().parent / "results" / "plan_accuracy.json"
    if args.probe_only:
        payload = json.loads(path.read_text())
        payload["engine_probe"] = {f"vocab_{v}": engine_probe(v) for v in (1024, 151_936)}
        path.write_text(json.dumps(payload, indent=2))
        print(json.dumps(payload["engine_probe"]))
        return
    sys.argv = sys.argv[:1]  # LightningCLI (the planner's parser) reads sys.argv too
    results = {}
    for name in args.configs.split(","):
        print(f"plan_accuracy: {name} …", file=sys.stderr, flush=True)
        results[name] = one(name)
        print(f"plan_accuracy: {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    if args.update:
        kept = json.loads(path.read_text())
        results, probe = {**kept["configs"], **results}, kept["engine_probe"]
    else:
        probe = {f"vocab_{v}": engine_probe(v) for v in (1024, 151_936)}
    rss_ok = sum(r["within_20pct"] for r in results.values())
    tensors_ok = sum(r["trainer_tensors"]["within_10pct"] for r in results.values())
    write("plan_accuracy", {"configs": results, "engine_probe": probe, "summary": {
        "peak_rss_within_20pct": f"{rss_ok}/{len(results)}", "trainer_tensors_within_10pct": f"{tensors_ok}/{len(results)}"}})  # fmt: skip


if __name__ == "__main__":
    main()
