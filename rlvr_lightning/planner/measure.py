"""The measurement the planner is held to: one real training step on real tensors, its peak accounted
by PyTorch's own `MemTracker` (tests/planner/test_planner.py and bench/plan_accuracy.py compare the plan with it).

Built apart from the planner's fake run on purpose: a real model with real weights, the trainer's padded
path (`policy_forward` selecting the real tokens), one steady step after the step that creates AdamW's
state. One prompt is a token shorter, as in every real batch: with no padding at all, transformers
drops the attention mask for SDPA's causal kernel, a choice it cannot make on tensors without data.
Without FSDP only (one process, CPU).
"""

from __future__ import annotations

import gc

import torch

from rlvr_lightning.planner.memory_trackers import tracker_hooking_trained_only
from rlvr_lightning.planner.trainer_memory import TrainerSetup


def real_step_peak_bytes(setup: TrainerSetup, seed: int = 0) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.forward import policy_forward
    from rlvr_lightning.models.lora import apply_lora, trainable_parameters
    from rlvr_lightning.parallel import checkpoint_layers
    from rlvr_lightning.rollout.types import RolloutTensors

    if setup.fsdp:
        raise ValueError("real_step_peak_bytes measures one process without FSDP")
    torch.manual_seed(seed)
    config = setup.model_config
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if setup.lora is not None:
        apply_lora(policy, setup.lora)
    trained = trainable_parameters(policy)
    if setup.with_reference:  # MemTracker fails on a second model's forward in one step
        raise ValueError("real_step_peak_bytes measures a step without a reference model")
    if setup.activation_checkpointing:
        checkpoint_layers(policy)
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    n, P, T = setup.rows, setup.prompt_tokens, setup.response_tokens
    ids = torch.randint(0, config.vocab_size, (n, P + T))
    attention = torch.ones(n, P + T, dtype=torch.long)
    attention[0, 0] = 0
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    batch = RolloutTensors(ids, attention, positions, torch.ones(n, T), torch.zeros(n, T), P, torch.ones(n, T))

    def old_logprobs():
        if setup.separate_old_pass:
            with torch.no_grad():
                policy_forward(policy, batch, 1.0, chunk_tokens=setup.chunk_tokens)

    def update():
        out = policy_forward(
            policy,
            batch,
            1.0,
            with_entropy=True,
            capture_lm_head=setup.capture_lm_head,
            chunk_tokens=setup.chunk_tokens,
        )
        out.logp.sum().backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # (a second micro-batch's pass, with the first one's gradients held, when the step accumulates)
    phases = [old_logprobs, update, *([update] if setup.accumulates else []), optimizer_step]
    for phase in phases:  # the first step creates AdamW's state
        phase()
    tracker = tracker_hooking_trained_only(MemTracker)()
    tracker.track_external(policy, optimizer)
    return peak_over_phases(tracker, phases)


def peak_over_phases(tracker, phases) -> int:
    """The tracker's peak bytes over `phases` run in turn. PyTorch's memory trackers measure one forward of a
    module per entry, so the tracker is entered once per phase, its module statistics cleared before each."""
    peak = 0
    for phase in phases:
        gc.collect()
        tracker.reset_mod_stats()
        with tracker:
            phase()
        peak = max(peak, next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])
    return peak
