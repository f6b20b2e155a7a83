"""PyTorch's memory trackers as the planner reads them: `FSDPMemTracker` under FSDP2, `MemTracker` otherwise,
hooking trained parameters only; their snapshots by the plan's categories, and which pass of a stage peaked."""

from __future__ import annotations

from contextlib import nullcontext

import torch

BREAKDOWN = {  # the trackers' categories → the plan's
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Parameter": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer_state", "Optstate": "optimizer_state",
    "Activation": "activations", "Temp": "temporaries",
    "All Gather": "communication", "Reduce Scatter": "communication",
    "Buffer": "buffers", "Inputs": "buffers", "Other": "buffers",
}  # fmt: skip


def memory_tracker(policy, optimizer, reference, fsdp: bool):
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


class NoTracker(nullcontext):
    def reset_mod_stats(self) -> None: ...

    def get_tracker_snapshot(self, kind: str) -> dict:
        return {}


def snapshot(tracker, kind: str) -> dict[str, int]:
    """The tracker's `current` or `peak` bytes by category on the (one, fake) device."""
    return next(iter(tracker.get_tracker_snapshot(kind).values()), {})


def categories(snapshot: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in snapshot.items():
        if key in BREAKDOWN:
            out[BREAKDOWN[key]] = out.get(BREAKDOWN[key], 0) + value
    return out


def which_pass(stage: str, tracker, policy) -> str:
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
