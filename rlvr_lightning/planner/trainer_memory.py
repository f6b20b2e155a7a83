"""The trainer's memory per rank, from the run's own step on tensors that hold no storage.

The policy (and the KL reference) is built from its configuration under PyTorch's `FakeTensorMode`,
sharded by the run's `fully_shard` (`parallel.shard_policy`) over a fake process group of the run's
world size, and stepped through the real code: `policy_forward` (the chunked LM head included) on a
worst-case micro-batch (every row at the longest prompt + response), the backward, gradient clipping
and AdamW's step. PyTorch's memory trackers (`FSDPMemTracker` under FSDP2, `MemTracker` otherwise)
account every tensor by category, after one optimizer step has created AdamW's state.

Two modelling choices, both stated in the plan's output:
  - On a GPU, attention is planned as a fused kernel (flash or memory-efficient: O(T) memory, as SDPA
    and flash-attention run there), by running the model's attention through SDPA's causal kernel;
    the worst case has no padding, so no mask is lost. On the CPU the model's own attention runs.
  - Memory and FLOPs at a fixed sequence length are affine in the rows of a forward (activations and
    the gathered hidden states grow with them; parameters, optimizer state and the LM head's chunk
    buffers do not, once there are a few chunks), so a large forward is measured at two small ones and
    extrapolated (`tests/planner/test_planner.py` holds it to full runs). This keeps a 7B plan to seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

BREAKDOWN = {  # the trackers' categories → the plan's
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Parameter": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer_state", "Optstate": "optimizer_state",
    "Activation": "activations", "Temp": "temporaries",
    "All Gather": "communication", "Reduce Scatter": "communication",
    "Buffer": "buffers", "Inputs": "buffers", "Other": "buffers",
}  # fmt: skip


@dataclass(frozen=True)
class TrainerSetup:
    """What the trainer's step holds in memory, read off the run's configuration."""

    model_config: object  # transformers' PretrainedConfig
    world_size: int  # ranks that shard the policy (1 without FSDP2)
    fsdp: bool
    fsdp_param_dtype: str  # compute dtype under FSDP2 (master weights stay fp32)
    precision: str  # trainer.precision (without FSDP2: 32-true, bf16-mixed, bf16-true, 16-mixed)
    activation_checkpointing: bool
    rows: int  # sequences in the largest forward
    prompt_tokens: int
    response_tokens: int
    chunk_tokens: int  # model.update.logprob_chunk_tokens
    with_reference: bool  # a KL term against the frozen initial policy: a copy of it
    separate_old_pass: bool  # θ_old from a no-grad forward before the update
    capture_lm_head: bool  # THR reads the LM head's inputs in the update's forward
    fused_attention: bool = False  # plan attention as a GPU's fused kernel (see the module's docstring)
    accumulates: bool = False  # several micro-batches per optimizer step: later ones run with gradients held
    lora: object | None = None  # models.lora.LoraSettings: adapters train, the base is frozen and is the reference


@dataclass(frozen=True)
class StagePeak:
    stage: str
    peak_bytes: int
    breakdown: dict[str, int]  # plan category → bytes at this stage's peak
    flops: int  # of this stage on this rank, as PyTorch's FlopCounterMode counts the ops that ran


@dataclass(frozen=True)
class TrainerMemory:
    stages: list[StagePeak]
    parameters: int  # the policy's parameter count
    trained: int = 0  # of which a LoRA policy's adapter (0: every parameter trains)

    @property
    def peak(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.peak_bytes)


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
        StagePeak(sb.stage, at(sa.peak_bytes, sb.peak_bytes),
                  {k: at(sa.breakdown.get(k, 0), sb.breakdown.get(k, 0)) for k in sb.breakdown}, at(sa.flops, sb.flops))
        for sa, sb in zip(a.stages, b.stages, strict=True)
    ]  # fmt: skip
    return TrainerMemory(stages, b.parameters, b.trained)


_MEASURED: dict[tuple, TrainerMemory] = {}  # a plan's fixes re-use the runs that differ only in rows


def _measured(setup: TrainerSetup, with_flops: bool) -> TrainerMemory:
    """Memory from a run under the memory tracker; FLOPs from a run of one row under PyTorch's FLOP
    counter, times the rows. Two runs: the FLOP counter, active with the tracker, defeats activation
    checkpointing (the tracker then sees every layer's activations kept)."""
    key = (setup.model_config.to_json_string(), *(getattr(setup, f.name) for f in dataclasses.fields(setup)[1:]))
    if key not in _MEASURED:
        _MEASURED[key] = _run_fake_step(setup, count_flops=False)
    memory = _MEASURED[key]
    if not with_flops:
        return memory
    per_row = _measured_flops(dataclasses.replace(setup, rows=1))
    stages = [dataclasses.replace(s, flops=f * setup.rows) for s, f in zip(memory.stages, per_row, strict=True)]
    return TrainerMemory(stages, memory.parameters, memory.trained)


def _measured_flops(setup: TrainerSetup) -> list[int]:
    key = ("flops", setup.model_config.to_json_string(), *(getattr(setup, f.name) for f in dataclasses.fields(setup)[1:]))
    if key not in _MEASURED:
        _MEASURED[key] = _run_fake_step(setup, count_flops=True)
    return [s.flops for s in _MEASURED[key].stages]


def _run_fake_step(setup: TrainerSetup, count_flops: bool) -> TrainerMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.lora import BaseModelView, apply_lora, trainable_parameters
    from rlvr_lightning.parallel import checkpoint_layers, shard_policy

    attention = {"attn_implementation": _fused_causal_attention()} if setup.fused_attention else {}
    # `from_config` writes the attention implementation into the config it is given: a copy, or every model
    # the caller builds later from its config gets the planner's mask-free causal attention (a packed forward
    # then attends across its sequences' boundaries).
    config = copy.deepcopy(setup.model_config)
    with fake_world(setup.world_size if setup.fsdp else 0) as mesh, FakeTensorMode():
        build = lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention).eval()  # noqa: E731
        policy = build()
        if setup.lora is not None:  # PEFT's own layers, as the run injects them; the reference is the base itself
            with _adapters_created_in_place():
                apply_lora(policy, setup.lora)
        # Without FSDP2 the reference is added after the run (its parameters, whole on every rank, and a
        # no-grad forward like θ_old's): PyTorch's MemTracker fails on a second model's forward in a step
        # (frozen parameters, and a KeyError in its backward hooks). Under FSDP2 it runs for real; its
        # parameters keep requires_grad (it runs under no_grad) because the trackers hook every parameter.
        reference = build() if setup.with_reference and setup.fsdp and setup.lora is None else None
        if setup.with_reference and setup.lora is not None:
            reference = BaseModelView(policy)
        if setup.fsdp:
            shard_policy(policy, mesh, setup.fsdp_param_dtype, setup.activation_checkpointing)
            if isinstance(reference, torch.nn.Module):
                shard_policy(reference, mesh, setup.fsdp_param_dtype)
        else:
            if setup.activation_checkpointing:
                checkpoint_layers(policy)
            if setup.precision.startswith("bf16-true"):  # Lightning converts the module to bf16
                policy.to(torch.bfloat16)
                reference = reference.to(torch.bfloat16) if isinstance(reference, torch.nn.Module) else reference
        trainable = trainable_parameters(policy)
        optimizer = torch.optim.AdamW(trainable, lr=1e-6)
        tracker = _NoTracker() if count_flops else _tracker(policy, optimizer, reference, setup.fsdp)
        with tracker:  # one step on zero gradients creates AdamW's state, as the run's first step does
            for p in trainable:
                p.grad = torch.zeros_like(p)
            # (and fills DTensor's sharding-propagation cache: its first run of an op builds global-shape
            # tensors that a GPU builds on the meta device, but the tracker counts)
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # Each stage starts from the state between steps (parameters, optimizer state, the reference): a
        # stage's peak is that state plus what the stage itself adds. (The trackers can still count an
        # earlier stage's freed autograd buffers at the next stage's entry; measuring from the entry
        # keeps one stage's accounting out of the next.)
        between_steps = _snapshot(tracker, "current")
        peaks = []
        for name, run in _step_stages(policy, reference, optimizer, setup):
            gc.collect()  # free the last stage's autograd graph now
            tracker.reset_mod_stats()  # per-module statistics are per forward; FSDP's tracker insists
            entry = _snapshot(tracker, "current")
            with tracker, FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS) if count_flops else nullcontext() as flops:
                run()
            if count_flops:
                peaks.append(StagePeak(name, 0, {}, flops.get_total_flops()))
                continue
            peak = _snapshot(tracker, "peak")
            baseline = {**between_steps, **{k: v for k, v in entry.items() if "Grad" in k}}  # gradients carry over
            baseline["Total"] = sum(v for k, v in baseline.items() if k != "Total")
            added = {k: baseline.get(k, 0) + peak.get(k, 0) - entry.get(k, 0) for k in peak}
            peaks.append(StagePeak(_which_pass(name, tracker, policy), added.get("Total", 0), _categories(added), 0))
        count = sum(p.numel() for p in policy.parameters())  # a DTensor counts its global shape
    if setup.with_reference and not setup.fsdp and setup.lora is None:
        peaks = _with_whole_reference(peaks, count * (2 if setup.precision.startswith("bf16-true") else 4))
    return TrainerMemory(peaks, count, sum(p.numel() for p in trainable) if setup.lora is not None else 0)


@contextmanager
def _adapters_created_in_place():
    """PEFT moves each new adapter layer to its base layer's device and dtype with `Module.to`, which swaps a
    fake parameter for its copy and fails while PEFT still holds a reference to it ("Couldn't swap
    Linear.weight"). Here the adapters are created where the base layer is already (the fake CPU device, fp32,
    as the run builds them), so `Module.to` is left out while they are injected."""
    to = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.nn.Module.to = to


def _with_whole_reference(peaks: list[StagePeak], reference_bytes: int) -> list[StagePeak]:
    """The stages with an unsharded reference model held throughout, and its no-grad forward (the same
    activations as θ_old's forward; before it when there is one)."""
    def plus(s: StagePeak, name: str | None = None) -> StagePeak:
        breakdown = {**s.breakdown, "reference": s.breakdown.get("reference", 0) + reference_bytes}
        return StagePeak(name or s.stage, s.peak_bytes + reference_bytes, breakdown, s.flops)

    out = [plus(s) for s in peaks]
    no_grad = next((s for s in out if "no grad" in s.stage), None)
    if no_grad is None:  # no θ_old pass: the reference forward is the update's forward without autograd
        return out
    return [*out[:1], dataclasses.replace(no_grad, stage="reference log-probs (no grad)"), *out[1:]]


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward FLOPs of SDPA's CPU flash kernel (absent from PyTorch's FLOP formulas): QKᵀ and PV, 2 FLOPs per
    multiply-add, half of it under a causal mask (what the GPU's kernels compute too)."""
    b, h, s_q, d = query_shape
    s_k = key_shape[-2]
    is_causal = bool(args[1]) if len(args) > 1 else bool(kwargs.get("is_causal", False))
    return int(4 * b * h * s_q * s_k * d * (0.5 if is_causal else 1.0))


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Backward: five matmuls of the forward's two (PyTorch's own SDPA backward formula, 2.5×)."""
    is_causal = bool(args[3]) if len(args) > 3 else bool(kwargs.get("is_causal", False))
    return int(2.5 * _attention_flops(query_shape, key_shape, value_shape, 0.0, is_causal))


_CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


def _fused_causal_attention() -> str:
    """The name of an attention function for transformers that runs SDPA's causal kernel without a mask
    (on the CPU: its flash kernel, O(T) memory like a GPU's fused kernels)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fused_causal(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("rlvr_plan_fused_causal", fused_causal)
    return "rlvr_plan_fused_causal"


def _step_stages(policy, reference, optimizer, setup: TrainerSetup) -> list[tuple[str, Callable[[], None]]]:
    from rlvr_lightning.models.forward import policy_forward
    from rlvr_lightning.models.lora import trainable_parameters
    from rlvr_lightning.rollout.types import RolloutTensors

    n, P, T = setup.rows, setup.prompt_tokens, setup.response_tokens
    ones = torch.ones(n, P + T, dtype=torch.long)
    batch = RolloutTensors(torch.zeros(n, P + T, dtype=torch.long), ones, torch.arange(P + T).expand(n, -1),
                           torch.ones(n, T), torch.zeros(n, T), P)  # fmt: skip
    autocast = _autocast(setup)

    def forward(model, grad: bool, capture: bool = False):
        with autocast, torch.set_grad_enabled(grad):
            return policy_forward(model, batch, 1.0, with_entropy=grad, capture_lm_head=capture,
                                  chunk_tokens=setup.chunk_tokens, unpadded=True)  # fmt: skip

    def forward_backward():
        forward(policy, grad=True, capture=setup.capture_lm_head).logp.sum().backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(trainable_parameters(policy), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    stages = []
    if setup.separate_old_pass:
        stages.append(("θ_old log-probs (no grad)", lambda: forward(policy, grad=False)))
    if reference is not None:
        stages.append(("reference log-probs (no grad)", lambda: forward(reference, grad=False)))
    stages.append(("update forward + backward", forward_backward))
    if setup.accumulates:  # the next micro-batch's pass, with the first one's gradients held
        stages.append(("update forward + backward, gradients held", forward_backward))
    return [*stages, ("optimizer step", optimizer_step)]


def _which_pass(stage: str, tracker, policy) -> str:
    """`update forward + backward` → the one of the two that reached the stage's peak, from the trackers'
    own record of the policy's peak in its forward and in its backward."""
    if "backward" not in stage:
        return stage
    peak = {}
    for state, shots in tracker.memory_tracking[policy].snapshots.items():
        name = str(getattr(state, "value", state)).replace("-", " ")  # "Peak-Forward" or "Peak Forward"
        if name in ("Peak Forward", "Peak Backward") and shots:
            peak[name.split()[1]] = max(next(iter(shot.values()), {}).get("Total", 0) for shot in shots)
    if len(peak) < 2:
        return stage
    which = "forward" if peak["Forward"] >= peak["Backward"] else "backward"
    return stage.replace("forward + backward", which)


def _autocast(setup: TrainerSetup):
    if setup.fsdp or not setup.precision.endswith("-mixed"):
        return nullcontext()  # FSDP2 casts the gathered parameters itself (MixedPrecisionPolicy)
    dtype = torch.bfloat16 if setup.precision.startswith("bf16") else torch.float16
    return torch.autocast("cpu", dtype=dtype)


def _tracker(policy, optimizer, reference, fsdp: bool):
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = tracker_hooking_trained_only(FSDPMemTracker)(policy, optimizer)
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = tracker_hooking_trained_only(MemTracker)()
        tracker.track_external(policy, optimizer)
    if isinstance(reference, torch.nn.Module):  # not a LoRA policy's base view: that is the policy itself
        tracker.track_external(reference)
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def tracker_hooking_trained_only(tracker_class):
    """PyTorch's memory tracker with gradient hooks on trained parameters only: it hooks every parameter a
    module holds to record its gradient, and a frozen parameter (a LoRA policy's base) refuses hooks ("cannot
    register a hook on a tensor that doesn't require gradient"); it never gets a gradient to record."""

    class Tracker(tracker_class):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())  # "already hooked"
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker


class _NoTracker(nullcontext):
    def reset_mod_stats(self) -> None: ...

    def get_tracker_snapshot(self, kind: str) -> dict:
        return {}


def _snapshot(tracker, kind: str) -> dict[str, int]:
    """The tracker's `current` or `peak` bytes by category on the (one, fake) device."""
    return next(iter(tracker.get_tracker_snapshot(kind).values()), {})


def _categories(snapshot: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        if key in BREAKDOWN:
            out[BREAKDOWN[key]] = out.get(BREAKDOWN[key], 0) + value
    return out


@contextmanager
def fake_world(world_size: int):
    """A device mesh over `world_size` ranks of PyTorch's fake process group (collectives that move
    nothing, so one process can run every rank's part of FSDP2); no mesh for 0."""
    if world_size == 0:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # the fake backend's store

    if dist.is_initialized():
        raise RuntimeError("the planner needs a process without a process group (plan before training starts)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
