"""The devices a plan can target: memory a process can allocate, and the published peaks the step-time
estimate divides by (dense bf16 tensor-core FLOP/s, memory bandwidth, the intra-node link).

Memory is what `torch.cuda.mem_get_info` reports as total on each card (a little under the marketing
figure: the driver keeps some); peaks are the vendors' datasheet figures for the SXM parts (dense, no
sparsity). `cpu` is this machine: the memory available now (`/proc/meminfo`), and a matmul throughput and
a copy bandwidth measured on the spot (no datasheet describes it; ranks on one machine talk through memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlvr_lightning.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float  # per device, allocatable
    tflops: float  # dense bf16 peak (fp32 on `cpu`), per device
    memory_tb_s: float  # memory bandwidth per device
    link_gb_s: float  # one direction, per device: NVLink (or PCIe) for FSDP's all-gathers
    gpu: bool = True
    # One direction, per device, between nodes: FSDP's collectives over several nodes run at the slower link.
    # The usual rail-optimised cluster gives each GPU its own NIC: InfiniBand NDR (400 Gb/s) on H100/H200
    # systems, HDR (200 Gb/s) on A100s, 100 Gb/s Ethernet on PCIe cards.
    network_gb_s: float = 50.0


GPUS = {
    "h100": Hardware("h100", 79.2, 989.4, 3.35, 450.0),  # H100 SXM5 80 GB, NVLink 4
    "h200": Hardware("h200", 139.8, 989.4, 4.8, 450.0),  # H200 SXM 141 GB, NVLink 4
    "a100-80g": Hardware("a100-80g", 79.2, 312.0, 2.039, 300.0, network_gb_s=25.0),  # A100 SXM4 80 GB, NVLink 3
    "a100-40g": Hardware("a100-40g", 39.4, 312.0, 1.555, 300.0, network_gb_s=25.0),  # A100 SXM4 40 GB
    "l40s": Hardware("l40s", 44.4, 362.1, 0.864, 32.0, network_gb_s=12.5),  # L40S 48 GB GDDR6, PCIe 4.0 x16
}
CHOICES = (*GPUS, "cpu")


def hardware(name: str) -> Hardware:
    """The named device; `cpu` is measured on this machine."""
    if name == "cpu":
        return this_cpu()
    if name not in GPUS:
        raise ConfigError(f"plan.hardware: unknown hardware {name!r}; valid: {', '.join(CHOICES)}")
    return GPUS[name]


def available_memory_gib() -> float:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), in GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def this_cpu() -> Hardware:
    import torch

    a = torch.randn(1024, 1024)
    a @ a  # warm-up
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    tflops = n * 2 * 1024**3 / (time.perf_counter() - t0) / 1e12
    src, dst = torch.ones(64 * 1024**2), torch.empty(64 * 1024**2)  # 256 MiB each
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    tb_s = 2 * src.nbytes / (time.perf_counter() - t0) / 1e12  # read + write
    return Hardware("cpu", available_memory_gib(), tflops, tb_s, tb_s * 1000, gpu=False)
