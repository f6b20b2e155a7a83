"""Step 1: the doctor's trainer-side rows on this device, by the doctor's own checks (`rlvr_lightning/doctor`):
an FSDP2 training step (bf16 compute on CUDA, one rank), the chunked LM head against the full logits, the HF
engine's log-probs against the trainer's, and sleep/wake where it applies (the HF engine has none: skipped).

Two configurations, both with `rollout.engine hf` (vLLM is not installed on the GPU machine): the GRPO preset
under the FSDP2 strategy, and the same with a LoRA adapter (docs/lora.md)."""

from __future__ import annotations

import dataclasses

import torch

from bench.gpu_check.record import REPO, attempt

CONFIGS = {
    "grpo, FSDP2": [],
    "grpo, FSDP2, LoRA r=16": ["--model.init_args.lora.rank", "16"],
}


def doctor_args(extra: list[str], workdir) -> list[str]:
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    return [
        "--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / "configs/algo/grpo.yaml"),
        "--config", str(REPO / "configs/strategy/fsdp.yaml"), "--model.init_args.compute.fsdp_param_dtype", dtype,
        "--rollout.engine", "hf", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(workdir), *extra,
    ]  # fmt: skip


def rows(extra: list[str], workdir, budget_s: float) -> dict:
    from rlvr_lightning.doctor import run_checks
    from rlvr_lightning.doctor.checks import CHECKS, FAIL, Setup
    from rlvr_lightning.plan import parse

    cfg, _ = parse(doctor_args(extra, workdir))
    setup = Setup(cfg, workdir)
    try:
        table = run_checks(setup, CHECKS, budget_s=budget_s)
    finally:
        setup.close()
    return {"device": str(setup.device), "trainer_dtype": setup.trainer_dtype, "engine_dtype": setup.engine_dtype,
            "rows": [dataclasses.asdict(r) for r in table], "failed": [r.check for r in table if r.result == FAIL]}  # fmt: skip


def run(ctx) -> dict:
    import sys
    import tempfile
    from pathlib import Path

    sys.argv = sys.argv[:1]  # LightningCLI (the doctor's parser) reads sys.argv too
    results: dict = {"configs": {}}
    for name, extra in CONFIGS.items():
        workdir = Path(tempfile.mkdtemp(dir=ctx.workdir))
        attempt(results["configs"], name, ctx.deadline, rows, extra, workdir, max(5.0, ctx.deadline.left))
    results["failed"] = [f"{name}: {check}" for name, r in results["configs"].items() for check in r.get("failed", [])]
    return results
