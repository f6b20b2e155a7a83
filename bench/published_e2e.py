"""`make plan`'s step time beside published end-to-end RL steps: each run planned as published (model, GPUs,
batch, length limits, mean lengths, engine settings), its planned total and generation set beside the
published ones, with the ratios.

The runs, their sources and what is inferred are in bench/README.md ("make plan's step time against published
end-to-end runs"). Every run is NeMo-RL's GRPO on Llama-3.1-8B-Instruct (OpenMathInstruct-2, 64 prompts × 32
samples, 512 samples per optimizer step, at most 4,096 tokens of prompt + response, colocated vLLM with CUDA
graphs at 0.6 of the GPU, sequence packing, KL to the reference): the only published H100 runs found that state
the mean lengths, and two of them the split of the step.

    .venv/bin/python bench/published_e2e.py     # ~5 min on 2 CPU cores (four 8B plans)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from common import write  # noqa: E402

# Every NeMo-RL run: prompts are OpenMathInstruct-2 problems in a short chain-of-thought template. Their mean is
# not published; the v0.5 page's 1,019-token mean sequence (prompt + response) against the v0.3 blog's ~795
# generated tokens for the same workload puts it near 224 (inferred). 512 + 3,584 fills the 4,096 limit.
COMMON = [
    "--data.model_name_or_path", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "h100",
    "--config", "configs/strategy/fsdp.yaml", "--rollout.group_size", "32",
    "--data.max_prompt_length", "512", "--rollout.max_response_length", "3584", "--mean-prompt-length", "224",
    "--model.init_args.num_mini_batches", "4", "--model.init_args.kl_coef", "0.01",
    "--model.init_args.compute.max_tokens_per_micro_batch", "4096", "--model.init_args.compute.packing", "true",
    "--rollout.gpu_memory_utilization", "0.6", "--rollout.enforce_eager", "false",
]  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    name: str
    flags: list[str]  # beyond COMMON
    step_s: float  # published: the whole step
    generation_s: float | None = None  # published: generation alone, where given
    trainer_s: float | None = None  # published: log-probs + policy training (+ the refit, where counted apart)
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)  # the published split as published


RUNS = [
    PublishedRun(
        "NeMo-RL v0.3, Megatron, 8×H100, mean response 795",
        ["--devices", "8", "--data.batch_size", "8", "--mean-response-length", "795", "--rollout.sleep_level", "1"],
        112.0, 58.0, 28.0 + 18.0, "data parallel only, no activation checkpointing; the GPU is inferred (H100)",
        {"generation": 58, "get logprobs": 18, "policy training": 28, "refit": 5},
    ),
    PublishedRun(
        "NeMo-RL v0.3, DTensor (FSDP2), 8×H100, mean response 777",
        ["--devices", "8", "--data.batch_size", "8", "--mean-response-length", "777", "--rollout.sleep_level", "1"],
        122.0, 57.0, 38.0 + 19.0, "FSDP2, no activation checkpointing; the GPU is inferred (H100)",
        {"generation": 57, "get logprobs": 19, "policy training": 38, "refit": 4},
    ),
    PublishedRun(
        "NeMo-RL v0.5, Megatron, 2×8 H100, mean sequence 1,019",
        ["--devices", "8", "--nodes", "2", "--data.batch_size", "4", "--mean-response-length", "795",
         "--model.init_args.compute.activation_checkpointing", "true", "--rollout.sleep_level", "1"],
        92.8, note="PP 2 with activation checkpointing; no split published; mean response inferred (1,019 − 224)",
    ),  # fmt: skip
    PublishedRun(
        "NeMo-RL v0.5, 1-step off-policy, 8 H100 generate + 8 train, mean sequence 1,123",
        ["--devices", "8", "--data.batch_size", "8", "--mean-response-length", "899", "--rollout.stream.max_staleness", "1",
         "--rollout.engine", "vllm-server", "--rollout.servers.replicas", "8",
         "--rollout.servers.cuda_devices", '["8", "9", "10", "11", "12", "13", "14", "15"]',
         "--rollout.gpu_memory_utilization", "0.8"],
        64.8, note="generation on 8 GPUs of its own, one step ahead; mean response inferred (1,123 − 224)",
    ),  # fmt: skip
]


def plan_run(run: PublishedRun) -> dict:
    from rlvr_lightning.plan import parse
    from rlvr_lightning.planner.preflight import plan_config
    from rlvr_lightning.planner.report import as_dict

    sys.argv = ["plan"]  # LightningCLI reads it
    cfg, _ = parse(["--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml", *COMMON, *run.flags])
    return as_dict(plan_config(cfg))


def compared(run: PublishedRun, plan: dict) -> dict:
    stages = plan["step_s_by_stage"]
    trainer = sum(v for k, v in stages.items() if k not in ("generation", "weight sync"))
    out = {
        "published": {"step_s": run.step_s, "generation_s": run.generation_s, "trainer_s": run.trainer_s, **run.parts},
        "planned": {"step_s": plan["step_s_expected"], "generation_s": stages.get("generation"),
                    "trainer_s": round(trainer, 2), "weight_sync_s": stages.get("weight sync"),
                    "worst_step_s": plan["step_s_worst"], "stages": stages, "generation": plan["generation"]["expected"],
                    "fits": plan["fits"], "peak_gib": plan["peak_gib_per_rank"]},
        "total_ratio": round(plan["step_s_expected"] / run.step_s, 3),
        "note": run.note,
    }  # fmt: skip
    if run.generation_s:
        out["generation_ratio"] = round(stages["generation"] / run.generation_s, 3)
    if run.trainer_s:
        out["trainer_ratio"] = round(trainer / run.trainer_s, 3)
    return out


def main() -> None:
    import os

    os.chdir(REPO)
    rows = {}
    for run in RUNS:
        rows[run.name] = compared(run, plan_run(run))
        ratios = {k: v for k, v in rows[run.name].items() if k.endswith("_ratio")}
        print(f"{run.name}: planned {rows[run.name]['planned']['step_s']} s, published {run.step_s} s, {ratios}", flush=True)
    write("published_e2e", {"runs": rows, "common_flags": COMMON})


if __name__ == "__main__":
    main()
