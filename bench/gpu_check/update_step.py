"""One trainer update (micro-batches' forward + backward, clipping, AdamW) measured on this device, and the
planner's prediction for the same update.

The measured update is the run's own code on one rank: the model built from its configuration with random
weights, `fully_shard` per decoder layer (`parallel.shard_policy`, FSDP2 with bf16 compute and fp32 master
weights on CUDA, fp32 on the CPU), `policy_forward` with the chunked LM head. Every row is at the full
prompt + response length (no padding: the planner's worst case, and what a packed micro-batch of the same
tokens holds). Memory on CUDA: `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the timed
steps; on the CPU, PyTorch's `FSDPMemTracker` over one step (the tracker the planner itself uses, here on
real tensors). The prediction is `planner.trainer_measurement.measure_trainer` on the same `TrainerSetup`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch

from bench.gpu_check.record import one_rank_group

GIB = 1024**3


@dataclass(frozen=True)
class UpdateShape:
    rows: int  # sequences per micro-batch
    prompt_tokens: int
    response_tokens: int
    micro_batches: int = 1  # per optimizer step (gradients accumulate)
    chunk_tokens: int = 2048  # model.compute.logprob_chunk_tokens
    activation_checkpointing: bool = False
    packing: bool = False
    compile_layers: bool = False  # model.compute.compile_layers (models.fast_paths)
    fused_kernels: str = "none"  # model.compute.fused_kernels
    reshard_after_forward: bool = True  # model.compute.reshard_after_forward
    fused_adamw: bool = False  # model.optim.fused

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.rows * (self.prompt_tokens + self.response_tokens)


def param_dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


def trainer_setup(model_config, shape: UpdateShape):
    from rlvr_lightning.planner.trainer_memory import TrainerSetup

    return TrainerSetup(
        model_config, 1, True, param_dtype(), "32-true", shape.activation_checkpointing, shape.rows,
        shape.prompt_tokens, shape.response_tokens, shape.chunk_tokens, with_reference=False, separate_old_pass=False,
        capture_lm_head=False, fused_attention=torch.cuda.is_available(), accumulates=shape.micro_batches > 1,
        reshard_after_forward=shape.reshard_after_forward,
    )  # fmt: skip


@cache  # the CPU's figures are measured: once, so that every figure of a check divides by the same ones
def device_hardware():
    """The planner's `Hardware` for this device (None for a GPU it does not list)."""
    from rlvr_lightning.planner.hardware import GPUS, hardware

    if not torch.cuda.is_available():
        return hardware("cpu")
    name = torch.cuda.get_device_name(0).lower()
    for key in ("h200", "h100", "l40s"):
        if key in name:
            return GPUS[key]
    if "a100" in name:
        return GPUS["a100-80g" if torch.cuda.get_device_properties(0).total_memory > 50 * GIB else "a100-40g"]
    return None


def planned(model_config, shape: UpdateShape) -> dict:
    """The planner's peak (PyTorch's tensors of the trainer) and its step-time estimate of the update."""
    from rlvr_lightning.planner.step_time import trainer_rate, update_seconds
    from rlvr_lightning.planner.trainer_measurement import measure_trainer

    trainer = measure_trainer(trainer_setup(model_config, shape))
    hw = device_hardware()
    update_flops = sum(s.flops for s in trainer.stages if s.stage.startswith("update"))
    if shape.micro_batches > 2:  # the planner runs two passes (the second with gradients held); the rest are alike
        held = next(s.flops for s in trainer.stages if s.stage.endswith("gradients held"))
        update_flops += (shape.micro_batches - 2) * held
    out = {"peak_gib": round(trainer.peak.peak_bytes / GIB, 4), "peak_stage": trainer.peak.stage,
           "update_flops": update_flops, "parameters": trainer.parameters}  # fmt: skip
    if hw is not None:
        seconds = update_seconds(hw, update_flops, model_config.num_hidden_layers, shape.micro_batches,
                                 shape.activation_checkpointing, trainer.parameters)  # fmt: skip
        out |= {"hardware": hw.name, "step_s": round(seconds, 4),
                "assumption": f"{trainer_rate(hw)}; AdamW at the planner's share of {hw.memory_tb_s:.3g} TB/s"}  # fmt: skip
    return out


def model_from(model_config, **kwargs):
    """`AutoModelForCausalLM.from_config` on a copy of `model_config`: it keeps the config it is given and writes
    its attention implementation into it (the packed forward's switch too), which would change the planner's
    cache key for the next variant of the same architecture (a miss costs a fake-tensor run, 15-30 s on the
    GPU machine)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(copy.deepcopy(model_config), **kwargs)


def model_flops_per_step(model_config, shape: UpdateShape) -> float:
    """Model FLOPs of one optimizer step, the usual MFU count: 6 × the matmul parameters (every Linear, the LM
    head included, the embedding lookup not) per token, plus causal attention's 6 × layers × 2 × s² × the
    attention width per sequence (forward QKᵀ and PV on half the scores, ×3 with the backward); activation
    checkpointing's recomputation is not counted."""
    with torch.device("meta"):
        model = model_from(model_config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    width = model_config.num_attention_heads * head_dim
    s = shape.prompt_tokens + shape.response_tokens
    sequences = shape.rows * shape.micro_batches
    attention = 6 * model_config.num_hidden_layers * 2 * s * s * width / 2 * sequences
    return 6 * linear * shape.tokens_per_step + attention


def _batch(vocab: int, shape: UpdateShape, device: torch.device, seed: int):
    from rlvr_lightning.rollout.types import RolloutTensors

    g = torch.Generator().manual_seed(seed)
    n, P, T = shape.rows, shape.prompt_tokens, shape.response_tokens
    ids = torch.randint(3, vocab, (n, P + T), generator=g)
    ones = torch.ones(n, P + T, dtype=torch.long)
    return RolloutTensors(ids, ones, torch.arange(P + T).expand(n, -1).contiguous(), torch.ones(n, T),
                          torch.zeros(n, T), P, torch.ones(n, T)).to(device)  # fmt: skip


def measured(model_config, shape: UpdateShape, workdir: Path, steps: int = 2, profile: bool = False) -> dict:
    """The update on this device: one warm-up step (it creates AdamW's state, and compiles where asked), then `steps`
    timed steps; with `profile`, one more under PyTorch's profiler (`profile_summary`)."""
    from torch.profiler import record_function

    from bench.gpu_check.profile_summary import profiled
    from rlvr_lightning.models.fast_paths import apply_fast_paths
    from rlvr_lightning.models.forward import policy_forward
    from rlvr_lightning.parallel import shard_policy
    from rlvr_lightning.training.optim import adamw

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with one_rank_group(workdir) as mesh:
        torch.manual_seed(0)
        with torch.device(device):  # random weights made where they live: no slow CPU initialisation of a 1.5B model
            policy = model_from(model_config, dtype=torch.float32).eval()
        policy.config.use_cache = False
        shard_policy(policy, mesh, param_dtype(), shape.activation_checkpointing, shape.reshard_after_forward)
        apply_fast_paths(policy, shape.compile_layers, shape.fused_kernels)  # as the trainer's `algos.wiring`
        optimizer = adamw(policy.parameters(), 1e-6, fused=shape.fused_adamw)
        batches = [_batch(model_config.vocab_size, shape, device, seed) for seed in range(shape.micro_batches)]
        losses: list[float] = []
        grad_norms: list[float] = []

        def micro_batch(batch) -> None:
            with record_function("forward"):
                out = policy_forward(policy, batch, 1.0, with_entropy=True, chunk_tokens=shape.chunk_tokens,
                                     packed=shape.packing)  # fmt: skip
                loss = -out.logp.sum() / batch.response_mask.sum()
            with record_function("backward"):
                loss.backward()
            losses.append(float(loss.detach()))

        def optimizer_step() -> None:
            with record_function("optimizer step"):
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        phases = [partial(micro_batch, b) for b in batches] + [optimizer_step]

        def step() -> None:
            for phase in phases:
                phase()

        step()
        # The initial weights' loss and gradient norm: the variants of a shape (packed, fast paths) compare here.
        first_loss, first_grad_norm = losses[0], grad_norms[0]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / steps
        out = {"step_s": round(seconds, 4), "tokens_per_s": round(shape.tokens_per_step / seconds, 1),
               "first_loss": first_loss, "first_grad_norm": first_grad_norm, "last_loss": losses[-1]}  # fmt: skip
        if cuda:
            out |= {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 4),
                    "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 4),
                    "memory_source": "torch.cuda.max_memory_allocated / max_memory_reserved"}  # fmt: skip
        else:
            out |= {"peak_allocated_gib": round(_tracked_peak(policy, optimizer, phases) / GIB, 4),
                    "peak_reserved_gib": None, "memory_source": "FSDPMemTracker (CPU: no allocator to read)"}  # fmt: skip
        if profile:
            out["profile"] = profiled(step)
    return out


def _tracked_peak(policy, optimizer, phases) -> int:
    """The peak over one step's phases (each micro-batch, the optimizer step) by PyTorch's FSDPMemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from rlvr_lightning.planner.measure import peak_over_phases
    from rlvr_lightning.planner.memory_trackers import tracker_hooking_trained_only

    return peak_over_phases(tracker_hooking_trained_only(FSDPMemTracker)(policy, optimizer), phases)


def compared(model_config, shape: UpdateShape, workdir: Path, steps: int = 2, profile: bool = False) -> dict | str:
    """Planned and measured side by side, with their ratios. The plan of a packed shape is the padded one's: the
    rows are all at full length, so both hold the same tokens (what differs is the attention kernel)."""
    t0 = time.perf_counter()
    plan = planned(model_config, shape)
    t1 = time.perf_counter()
    real = measured(model_config, shape, workdir, steps, profile)
    out = {"planned": plan, "measured": real, "tokens_per_step": shape.tokens_per_step,
           "seconds": {"plan": round(t1 - t0, 1), "measure": round(time.perf_counter() - t1, 1)}}  # fmt: skip
    out["memory_ratio_planned_to_allocated"] = round(plan["peak_gib"] / real["peak_allocated_gib"], 3)
    if "step_s" in plan:
        out["time_ratio_planned_to_measured"] = round(plan["step_s"] / real["step_s"], 3)
        # The share of the dense peak the update reached: the counted FLOPs over the measured step.
        out["trainer_efficiency_measured"] = round(plan["update_flops"] / real["step_s"] / (device_hardware().tflops * 1e12), 4)
    return out
