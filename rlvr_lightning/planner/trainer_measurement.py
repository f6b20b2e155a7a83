"""The trainer's memory per rank, from the run's own step on tensors that hold no storage.

The policy (and the KL reference) is built from its configuration under PyTorch's `FakeTensorMode`,
sharded by the run's `fully_shard` (`parallel.shard_policy`) over a fake process group of the run's
world size, and stepped through the real code: `policy_forward` (the chunked LM head included) on a
worst-case micro-batch (every row at the longest prompt + response), the backward, gradient clipping
and AdamW's step (`fake_step.py`). PyTorch's memory trackers (`FSDPMemTracker` under FSDP2, `MemTracker`
otherwise; `memory_trackers.py`) account every tensor by category, after one optimizer step has created
AdamW's state.

Two modelling choices, both stated in the plan's output:
  - On a GPU, attention is planned as a fused kernel (flash or memory-efficient: O(T) memory, as SDPA
    and flash-attention run there), by running the model's attention through SDPA's causal kernel
    (`planned_attention.py`); the worst case has no padding, so no mask is lost. On the CPU the model's
    own attention runs.
  - Memory and FLOPs at a fixed sequence length are affine in the rows of a forward (activations and
    the gathered hidden states grow with them; parameters, optimizer state and the LM head's chunk
    buffers do not, once there are a few chunks), so a large forward is measured at two small ones and
    extrapolated (`tests/planner/test_planner.py` holds it to full runs). This keeps a 7B plan to seconds.
"""

from __future__ import annotations

import dataclasses
import math

from rlvr_lightning.planner.fake_step import run_fake_step
from rlvr_lightning.planner.trainer_memory import StagePeak, TrainerMemory, TrainerSetup


def measure_trainer(setup: TrainerSetup, with_flops: bool = True) -> TrainerMemory:
    """The trainer's memory (and FLOPs, or 0) per rank, per stage; a forward of many rows extrapolated from
    two smaller ones (r and 2r rows, r the fewest rows that give the LM head three chunks: below that its
    chunk buffers still grow with the rows)."""
    r = 1 if setup.chunk_tokens <= 0 else max(1, math.ceil(3 * setup.chunk_tokens / setup.response_tokens))
    if setup.rows <= 2 * r:
        return _measured(setup, with_flops)
    a = _measured(dataclasses.replace(setup, rows=r), with_flops)
    b = _measured(dataclasses.replace(setup, rows=2 * r), with_flops)
    t = (setup.rows - r) / r  # 0 at r rows, 1 at 2r

    def at(x: int, y: int) -> int:
        return round(x + (y - x) * t)

    stages = [
        StagePeak(
            sb.stage,
            at(sa.peak_bytes, sb.peak_bytes),
            {k: at(sa.breakdown.get(k, 0), sb.breakdown.get(k, 0)) for k in sb.breakdown},
            at(sa.flops, sb.flops),
        )
        for sa, sb in zip(a.stages, b.stages, strict=True)
    ]
    return TrainerMemory(stages, b.parameters, b.trained)


_MEASURED: dict[tuple, TrainerMemory] = {}  # a plan's fixes re-use the runs that differ only in rows


def _measured(setup: TrainerSetup, with_flops: bool) -> TrainerMemory:
    """Memory from a run under the memory tracker; FLOPs from a run of one row under PyTorch's FLOP
    counter, times the rows. Two runs: the FLOP counter, active with the tracker, defeats activation
    checkpointing (the tracker then sees every layer's activations kept)."""
    key = (setup.model_config.to_json_string(), *(getattr(setup, f.name) for f in dataclasses.fields(setup)[1:]))
    if key not in _MEASURED:
        _MEASURED[key] = run_fake_step(setup, count_flops=False)
    memory = _MEASURED[key]
    if not with_flops:
        return memory
    per_row = _measured_flops(dataclasses.replace(setup, rows=1))
    stages = [dataclasses.replace(s, flops=f * setup.rows) for s, f in zip(memory.stages, per_row, strict=True)]
    return TrainerMemory(stages, memory.parameters, memory.trained)


def _measured_flops(setup: TrainerSetup) -> list[int]:
    key = (
        "flops",
        setup.model_config.to_json_string(),
        *(getattr(setup, f.name) for f in dataclasses.fields(setup)[1:]),
    )
    if key not in _MEASURED:
        _MEASURED[key] = run_fake_step(setup, count_flops=True)
    return [s.flops for s in _MEASURED[key].stages]
