"""A step-time estimate per stage, from counted FLOPs and bytes against the hardware's published peaks.

An estimate, not a measurement: the trainer's FLOPs are those PyTorch's `FlopCounterMode` counts in the
planner's own run of one micro-batch (attention, the chunked LM head's recomputation and activation
checkpointing included), divided by the device's dense peak times TRAINER_EFFICIENCY; FSDP's
all-gathers and reduce-scatters are bytes over the intra-node link, overlapped with compute (the larger
of the two counts). Generation is vLLM's decode as a memory-bound loop: every decode step reads the
weights once and the KV cache of the sequences in flight, at DECODE_EFFICIENCY of the bandwidth, every
sequence running to `rollout.max_response_length` (the worst case the memory plan also takes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlvr_lightning.planner.engine_memory import EngineShare, dtype_bytes, vllm_batch_limits
from rlvr_lightning.planner.run_spec import RunSpec
from rlvr_lightning.planner.trainer_memory import TrainerMemory

TRAINER_EFFICIENCY = 0.4  # share of dense peak FLOP/s a trainer's matmuls sustain (typical FSDP MFU: 0.3–0.5)
PREFILL_EFFICIENCY = 0.5
DECODE_EFFICIENCY = 0.7  # share of peak memory bandwidth a decode step sustains


@dataclass(frozen=True)
class StepTime:
    stages: dict[str, float]  # seconds per rollout batch, by stage
    assumptions: list[str]

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def estimate_step(spec: RunSpec, trainer: TrainerMemory, engine: EngineShare) -> StepTime:
    hw = spec.hardware
    flop_s = hw.tflops * 1e12 * TRAINER_EFFICIENCY
    micro_batches = math.ceil(spec.sequences_per_rank / spec.rows_per_forward)
    W = spec.world_size if spec.fsdp else 1
    gathered = trainer.parameters * (2 if spec.fsdp_param_dtype == "bfloat16" else 4) * (W - 1) / W if spec.fsdp else 0
    link = hw.link_gb_s * 1e9
    stages: dict[str, float] = {"generation": generation_seconds(spec, trainer.parameters, engine)}
    for s in trainer.stages:
        if s.stage == "optimizer step":
            # AdamW reads and writes the rank's fp32 parameters, gradients and two moments: ~7 × 4 bytes each.
            shard = (trainer.trained or trainer.parameters) / W  # a LoRA policy's optimizer steps its adapter
            stages[s.stage] = spec.num_mini_batches * spec.ppo_epochs * shard * 28 / (hw.memory_tb_s * 1e12 * DECODE_EFFICIENCY)
            continue
        passes = spec.ppo_epochs if s.stage.startswith("update") else 1
        comm = gathered * (3 if s.stage.startswith("update") else 1) / link  # forward + backward gathers, reduce-scatter
        name = "update forward + backward" if s.stage.startswith("update") else s.stage
        stages[name] = passes * micro_batches * max(s.flops / flop_s, comm)
    if spec.engine != "hf":
        adapter_only = spec.lora is not None and spec.lora.sync == "adapter"
        sent = trainer.trained if adapter_only else trainer.parameters - trainer.trained
        stages["weight sync"] = sent * dtype_bytes(spec.engine_dtype, spec.model_config) / link
    assumptions = [
        f"trainer at {TRAINER_EFFICIENCY:.0%} of {hw.tflops:.3g} TFLOP/s; FLOPs counted by PyTorch on one micro-batch × {micro_batches} micro-batches",
        f"generation: every sequence to {spec.max_response_length} tokens; decode at {DECODE_EFFICIENCY:.0%} of {hw.memory_tb_s:.3g} TB/s, "
        f"prefill at {PREFILL_EFFICIENCY:.0%} of peak",
    ]
    if spec.fsdp and W > 1:
        assumptions.append(f"FSDP collectives over {hw.link_gb_s:.3g} GB/s per device, overlapped with compute")
    if spec.batches_ahead:
        assumptions.append("rollout.batches_ahead 1: generation overlaps the update; the total counts both")
    return StepTime(stages, assumptions)


def generation_seconds(spec: RunSpec, parameters: int, engine: EngineShare) -> float:
    """Prefill of every prompt, then max_response_length decode steps per round of sequences in flight
    (as many as the KV cache and vLLM's max_num_seqs allow)."""
    hw, cfg = spec.hardware, spec.model_config
    P, T, N = spec.max_prompt_length, spec.max_response_length, spec.sequences_per_rank
    nbytes = dtype_bytes(spec.engine_dtype, cfg)
    max_num_seqs = vllm_batch_limits(hw)[0] if spec.engine != "hf" else N
    in_flight = max(1, min(N, max_num_seqs, engine.kv_tokens // (P + T) if engine.kv_tokens else N))
    rounds = math.ceil(N / in_flight)
    prefill = 2 * parameters * P * N / (hw.tflops * 1e12 * PREFILL_EFFICIENCY)
    bandwidth = hw.memory_tb_s * 1e12 * DECODE_EFFICIENCY
    weights = parameters * nbytes
    kv_read = in_flight * (P + T / 2) * engine.kv_bytes_per_token  # the mean context over the round
    compute = 2 * parameters * in_flight / (hw.tflops * 1e12 * PREFILL_EFFICIENCY)
    return prefill + rounds * T * max((weights + kv_read) / bandwidth, compute)
