"""Where one update's time goes, from PyTorch's profiler: the top kernels and their share of the kernels' time, the
time outside kernels, and the phases the update step marks (each micro-batch's forward and backward, the chunked
LM head's forward and backward inside them, the optimizer step). On the CPU (tiny shapes) the same summary of the
operators' own CPU time: the rehearsal of the code, not a figure to read."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PHASES = ("forward", "backward", "optimizer step", "chunked LM head forward", "chunked LM head backward")
TOP = 15


def profiled(step: Callable[[], None]) -> dict:
    """One run of `step` under the profiler, summarised."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summary(prof.key_averages(), wall, cuda)


def summary(averages, wall_s: float, cuda: bool) -> dict:
    """The summary of `averages` (`profile.key_averages()`) for a step of `wall_s` (profiled: the profiler's own
    overhead included, a few percent)."""
    from torch.autograd import DeviceType

    # A `record_function` range appears twice on CUDA: as the CPU range and as a `gpu_user_annotation` spanning its
    # kernels on the GPU's timeline (device type CUDA, `is_user_annotation`): not a kernel, and the phase's device time.
    annotation = lambda e: getattr(e, "is_user_annotation", False)  # noqa: E731
    if cuda:
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA and not annotation(e) and e.self_device_time_total > 0]
        own = lambda e: e.self_device_time_total  # noqa: E731 - µs of the kernel itself
    else:
        kernels = [e for e in averages if e.self_cpu_time_total > 0 and e.key not in PHASES]
        own = lambda e: e.self_cpu_time_total  # noqa: E731
    total = sum(own(e) for e in kernels) / 1e6
    top = sorted(kernels, key=own, reverse=True)[:TOP]
    on_cpu = {e.key: e for e in averages if e.device_type == DeviceType.CPU}
    on_gpu = {e.key: e for e in averages if e.device_type == DeviceType.CUDA and annotation(e)}
    phases = {}
    for name in PHASES:
        if name in on_cpu:
            e, span = on_cpu[name], on_gpu.get(name)
            # (the GPU span: the backward's kernels are launched from autograd's thread, outside the CPU range)
            device = None if span is None else max(span.device_time_total, span.cpu_time_total) / 1e6
            phases[name] = {"calls": e.count, "cpu_s": round(e.cpu_time_total / 1e6, 5),
                            "device_s": round(device, 5) if device is not None else None}  # fmt: skip
    out = {
        "wall_s": round(wall_s, 4),
        "measured_on": "CUDA kernels (self device time)" if cuda else "CPU operators (self CPU time)",
        "kernels_s": round(total, 4),
        "top": [{"name": e.key[:160], "calls": e.count, "seconds": round(own(e) / 1e6, 5),
                 "share": round(own(e) / 1e6 / total, 4) if total else 0.0} for e in top],  # fmt: skip
        "phases": phases,
    }
    if cuda:  # one stream does nearly all the work: what the kernels leave of the step is the host's
        out["outside_kernels_s"] = round(max(0.0, wall_s - total), 4)
        out["outside_kernels_share"] = round(max(0.0, 1 - total / wall_s), 4)
    return out
