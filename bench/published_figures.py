"""The planner beside published GPU figures: peak memory per rank and step time of FSDP2 trainers on H100s,
each planned at its published setup (model, tokens per micro-batch, micro-batches per step, GPUs,
activation checkpointing, LM-head chunking, bf16 compute with fp32 master weights and AdamW).

The figures (sources and setups in bench/README.md, "The planner against published figures"):
  prime-rl's RL trainer benchmarks (H100 80 GB, trainer alone, torch.compile, FA3, reserved memory) and
  torchtitan's Llama-3.1-8B FSDP benchmark (H100 96 GB, selective activation checkpointing).
Planned as the trainer alone (no rollout engine on the GPU, no KL reference): the planner's trainer peak
(PyTorch's tensors; no CUDA-context allowance, which reserved memory does not count either) is set beside
the published reserved memory; the step time is the planner's update time (planner.step_time.update_seconds: the
counted FLOPs at the matmuls' efficiency, the per-layer costs and AdamW's step over the rank's shard).

    .venv/bin/python bench/published_figures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

FIGURES = [  # name, model, GPUs, tokens per micro-batch, micro-batches, AC, LM-head chunk, published GiB, published s
    ("prime-rl A1: Qwen3-0.6B RL, 1×H100, 16k", "Qwen/Qwen3-0.6B", 1, 16_384, 2, True, 2048, 12.53, 1.99),
    ("prime-rl A2: Qwen3-0.6B RL, 1×H100, 64k", "Qwen/Qwen3-0.6B", 1, 65_536, 2, True, 2048, 19.56, 12.18),
    ("prime-rl A3: Qwen3-4B RL, 8×H100, 16k", "Qwen/Qwen3-4B", 8, 16_384, 2, True, 2048, 17.10, 4.69),
    ("prime-rl A4: Qwen3-4B RL, 8×H100, 64k", "Qwen/Qwen3-4B", 8, 65_536, 2, True, 2048, 36.10, 30.29),
    ("prime-rl A5: Qwen3-4B SFT (full logits), 8×H100, 16k", "Qwen/Qwen3-4B", 8, 16_384, 2, True, 0, 54.63, 5.02),
    # torchtitan's time: 2 × 8,192 tokens per GPU per step at its published 5,762 tokens/s/GPU = 2.84 s.
    ("torchtitan B1: Llama-3.1-8B, 8×H100 96GB, 2×8k, selective AC (planned: full AC)", "meta-llama/Llama-3.1-8B", 8, 8192, 1, True, 0, 82.4, 2.84),
    ("torchtitan B1 (planned without AC)", "meta-llama/Llama-3.1-8B", 8, 8192, 1, False, 0, 82.4, 2.84),
]  # fmt: skip


def plan_figure(model: str, gpus: int, tokens: int, micro_batches: int, checkpointing: bool, chunk: int, rows: int = 1):
    from rlvr_lightning.planner.hardware import GIB, hardware
    from rlvr_lightning.planner.models import model_config
    from rlvr_lightning.planner.step_time import update_seconds
    from rlvr_lightning.planner.trainer_measurement import measure_trainer
    from rlvr_lightning.planner.trainer_memory import TrainerSetup

    setup = TrainerSetup(model_config(model), gpus, True, "bfloat16", "32-true", checkpointing, rows, 1, tokens - 1, chunk,
                         with_reference=False, separate_old_pass=False, capture_lm_head=False, fused_attention=True,
                         accumulates=micro_batches > 1)  # fmt: skip
    trainer = measure_trainer(setup)
    update = next(s for s in trainer.stages if s.stage.startswith("update"))
    h100 = hardware("h100")
    seconds = update_seconds(h100, micro_batches * update.flops, setup.model_config.num_hidden_layers, micro_batches,
                             checkpointing, trainer.parameters / gpus)  # AdamW steps the rank's shard
    return trainer.peak.peak_bytes / GIB, trainer.peak.stage, seconds, trainer.peak.breakdown


def main() -> None:
    from rlvr_lightning.planner.hardware import GIB

    rows = {}
    for name, model, gpus, tokens, micro, ac, chunk, gib, seconds in FIGURES:
        local_batch = 2 if name.startswith("torchtitan") else 1  # torchtitan: local batch 2 of 8,192 tokens
        planned_gib, stage, planned_s, breakdown = plan_figure(model, gpus, tokens, micro, ac, chunk, rows=local_batch)
        rows[name] = {
            "published_peak_gib": gib, "planned_peak_gib": round(planned_gib, 2), "memory_ratio": round(planned_gib / gib, 3),
            "peak_stage": stage, "breakdown_gib": {k: round(v / GIB, 2) for k, v in breakdown.items()},
            "published_step_s": seconds, "planned_step_s": round(planned_s, 2),
            "time_ratio": round(planned_s / seconds, 3) if seconds else None,
        }  # fmt: skip
        print(name, rows[name], flush=True)
    write("published_figures", {"figures": rows})


if __name__ == "__main__":
    main()
