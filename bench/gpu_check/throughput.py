"""Step 3: trainer throughput and MFU at prime-rl's published trainer setup, beside the planner's prediction.

prime-rl's RL trainer benchmark A1 (bench/published_figures.py, bench/README.md): Qwen3-0.6B on one H100,
FSDP2 with bf16 compute and fp32 master weights, full activation checkpointing, the LM head chunked by
2,048, two micro-batches of one 16,384-token sequence per step. It reports 11.9k tokens/s and 11.1% MFU
(by its own FLOP count; ours is `update_step.model_flops_per_step`). MFU is against the card's dense bf16
peak from `planner/hardware.py` (on the CPU: the fp32 matmul rate the planner measures). The padded update is
profiled too (`profile_summary`: the top kernels, the time outside kernels, the LM head, the optimizer step).
"""

from __future__ import annotations

from dataclasses import replace

from bench.gpu_check.planner_check import shrunk
from bench.gpu_check.record import attempt
from bench.gpu_check.update_step import UpdateShape, compared, device_hardware, model_flops_per_step

PUBLISHED = {"tokens_per_s": 11_900, "mfu": 0.111}
A1 = "prime-rl A1: Qwen3-0.6B RL, 1×H100, 16k"
FULL = UpdateShape(rows=1, prompt_tokens=1, response_tokens=16_383, micro_batches=2, chunk_tokens=2048,
                   activation_checkpointing=True)  # fmt: skip
TINY = replace(FULL, response_tokens=255, chunk_tokens=64)


def published() -> dict:
    import sys

    from bench.gpu_check.record import REPO

    sys.path.insert(0, str(REPO / "bench"))
    from published_figures import FIGURES

    row = next(f for f in FIGURES if f[0] == A1)
    return {"setup": A1, "peak_reserved_gib": row[7], "step_s": row[8], **PUBLISHED}


def with_mfu(result: dict, config, shape: UpdateShape) -> dict:
    hw = device_hardware()
    if hw is None or not isinstance(result, dict) or "measured" not in result:
        return result
    flops = model_flops_per_step(config, shape)
    peak = hw.tflops * 1e12
    result["model_flops_per_step"] = flops
    result["mfu"] = round(flops / result["measured"]["step_s"] / peak, 4)
    if "step_s" in result.get("planned", {}):
        result["planned"]["tokens_per_s"] = round(shape.tokens_per_step / result["planned"]["step_s"], 1)
        result["planned"]["mfu"] = round(flops / result["planned"]["step_s"] / peak, 4)
    result["mfu_against"] = f"{hw.name}: {hw.tflops:.4g} TFLOP/s dense" + (" bf16" if hw.gpu else " (measured fp32 matmul)")
    return result


def run(ctx) -> dict:
    from rlvr_lightning.planner.models import model_config

    config = model_config("Qwen/Qwen3-0.6B")
    config = shrunk(config) if ctx.tiny else config
    results: dict = {"published": published(), "runs": {}}
    for packing in (False, True):
        shape = replace(TINY if ctx.tiny else FULL, packing=packing)
        key = "packed" if packing else "padded (one sequence per micro-batch: no padding)"
        done = attempt(results["runs"], key, ctx.deadline, compared, config, shape, ctx.workdir, steps=3,
                       profile=not packing)  # where the time goes: the padded update, prime-rl's own layout
        with_mfu(done, config, shape)
    return results
