"""One run of the trainer's step on fake tensors: the policy (and the KL reference) built from its configuration
under `FakeTensorMode`, sharded over a fake world, and each stage of the step run under PyTorch's memory
tracker (or its FLOP counter). The approach and its modelling choices: `trainer_measurement.py`."""

from __future__ import annotations

import copy
import dataclasses
import gc
from contextlib import contextmanager, nullcontext

import torch

from rlvr_lightning.planner.fake_step_stages import step_stages
from rlvr_lightning.planner.fake_world import fake_world
from rlvr_lightning.planner.memory_trackers import NoTracker, categories, memory_tracker, snapshot, which_pass
from rlvr_lightning.planner.planned_attention import CPU_ATTENTION_FLOPS, fused_causal_attention
from rlvr_lightning.planner.trainer_memory import StagePeak, TrainerMemory, TrainerSetup


def run_fake_step(setup: TrainerSetup, count_flops: bool) -> TrainerMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.lora import BaseModelView, apply_lora, trainable_parameters
    from rlvr_lightning.parallel import checkpoint_layers, shard_policy

    attention = {"attn_implementation": fused_causal_attention()} if setup.fused_attention else {}
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
            shard_policy(policy, mesh, setup.fsdp_param_dtype, setup.activation_checkpointing, setup.reshard_after_forward)
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
        tracker = NoTracker() if count_flops else memory_tracker(policy, optimizer, reference, setup.fsdp)
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
        between_steps = snapshot(tracker, "current")
        peaks = []
        for name, run in step_stages(policy, reference, optimizer, setup):
            gc.collect()  # free the last stage's autograd graph now
            tracker.reset_mod_stats()  # per-module statistics are per forward; FSDP's tracker insists
            entry = snapshot(tracker, "current")
            with (
                tracker,
                FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
                if count_flops
                else nullcontext() as flops,
            ):
                run()
            if count_flops:
                peaks.append(StagePeak(name, 0, {}, flops.get_total_flops()))
                continue
            peak = snapshot(tracker, "peak")
            baseline = {**between_steps, **{k: v for k, v in entry.items() if "Grad" in k}}  # gradients carry over
            baseline["Total"] = sum(v for k, v in baseline.items() if k != "Total")
            added = {k: baseline.get(k, 0) + peak.get(k, 0) - entry.get(k, 0) for k in peak}
            peaks.append(StagePeak(which_pass(name, tracker, policy), added.get("Total", 0), categories(added), 0))
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
