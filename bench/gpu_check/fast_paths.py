"""Step: the update at prime-rl's A1 setup (`throughput.FULL`) with each fast path and memory setting, side by side
in one process, the one that chooses their defaults.

This step's process runs with the CUDA allocator's expandable segments (`__main__.STEP_ENV`), so its reserved
memory set beside throughput.json's (the default allocator, the same update) is what they save. The variants:
the LM head's chunk (2,048 as prime-rl publishes, 1,024 the library's default, 512), compiled decoder layers,
FSDP2 keeping each layer's gathered weights from forward to backward (`model.compute.reshard_after_forward
false`), AdamW's fused kernel (`model.optim.fused`), Liger's kernels (CUDA only), and compiled layers with Liger. Each reports tokens/s, MFU, peak allocated and reserved memory,
and its first loss and gradient norm beside the plain update's: the same weights and tokens, so a fast path that
changes the meaning shows there (bf16 rounding moves the loss by 1e-4 or less, the norm by 1e-3). Then, budget
allowing, the planner's peak for the variants whose memory it models (the chunks, the kept weights).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch

from bench.gpu_check.planner_check import shrunk
from bench.gpu_check.record import attempt
from bench.gpu_check.throughput import FULL, TINY, with_mfu
from bench.gpu_check.update_step import measured, planned
from rlvr_lightning.models.fast_paths import disagreement

PLAIN = "plain (chunk 2048, as throughput.json)"
KEPT = "weights kept gathered from forward to backward"
VARIANTS = {  # name → the UpdateShape fields it changes; Liger's measured last: its patches stay in the process
    PLAIN: {},
    "chunk 1024": {"chunk_tokens": 1024},
    "chunk 512": {"chunk_tokens": 512},
    "compiled layers": {"compile_layers": True},
    KEPT: {"reshard_after_forward": False},
    "fused AdamW": {"fused_adamw": True},
    "liger": {"fused_kernels": "liger"},
    "compiled layers + liger, chunk 1024": {"compile_layers": True, "fused_kernels": "liger", "chunk_tokens": 1024},
}
CXX = ("g++", "c++", "clang++")  # what inductor's CPU backend builds its kernels with


def agreement(result: dict, plain: dict) -> None:
    """The variant's first loss and gradient norm against the plain update's, an `error` where they differ in meaning."""
    loss_gap = result["first_loss"] - plain["first_loss"]
    norm_gap = result["first_grad_norm"] / plain["first_grad_norm"] - 1
    result |= {"first_loss_minus_plain": loss_gap, "first_grad_norm_relative_to_plain": norm_gap}
    problem = disagreement(loss_gap, norm_gap)
    if problem:
        result["error"] = problem


def measure(results: dict, name: str, config, base, ctx) -> None:
    """One variant measured into `results["runs"][name]` (or why not), beside the plain update's figures."""
    change = VARIANTS[name]
    if change.get("fused_kernels") == "liger" and not torch.cuda.is_available():
        results["runs"][name] = {"skipped": "Liger's kernels need CUDA"}
        return
    if change.get("compile_layers") and not torch.cuda.is_available() and not any(map(shutil.which, CXX)):
        results["runs"][name] = {"skipped": "torch.compile on the CPU needs a C++ compiler"}
        return
    shape = replace(base, **change)
    done = attempt(results["runs"], name, ctx.deadline, measured, config, shape, ctx.workdir, steps=3)
    if isinstance(done, dict) and "step_s" in done:
        results["runs"][name] = with_mfu({"measured": done}, config, shape)
        if name != PLAIN and "measured" in results["runs"].get(PLAIN, {}):
            agreement(done, results["runs"][PLAIN]["measured"])


def run(ctx) -> dict:
    from rlvr_lightning.planner.models import model_config

    config = model_config("Qwen/Qwen3-0.6B")
    config = shrunk(config) if ctx.tiny else config
    base = TINY if ctx.tiny else FULL
    results: dict = {"allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "runs": {}, "planned_peak_gib": {}}
    liger = [n for n, c in VARIANTS.items() if c.get("fused_kernels") == "liger"]
    for name in [n for n in VARIANTS if n not in liger]:
        measure(results, name, config, base, ctx)
    # The variants whose memory the planner models (throughput.json has the plain update's plan), before Liger's:
    # its patches replace transformers' own classes in this process, which the planner's fake model would then run.
    for name in ("chunk 1024", "chunk 512", KEPT):
        attempt(results["planned_peak_gib"], name, ctx.deadline,
                lambda n=name: planned(config, replace(base, **VARIANTS[n]))["peak_gib"], reserve=30)  # fmt: skip
    for name in liger:
        measure(results, name, config, base, ctx)
    return results
