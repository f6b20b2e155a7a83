"""One kernel path for CPU computation on every x86-64 processor, so that a CPU run's numbers do not depend on the
machine it ran on.

PyTorch picks its vectorised kernels by the processor's vector width (ATen's AVX2 or AVX-512 builds of each
kernel; MKL's and oneDNN's code paths alike), and they round differently: the embedded warm start came out with
other weights on an AVX2 processor than on an AVX-512 one, and so did every run after it. Importing
`rlvr_lightning` makes this process, and every process it starts (vLLM's engines and servers, the ranks; they
inherit the environment), run ATen's AVX2 kernels with MKL and oneDNN capped at AVX2: the widest path every x86-64
server processor of the last decade has, and on the AVX-512 machines measured no slower for these models
(docs/embedded-default.md). ATen reads its setting at its first vectorised operation, so this must run before
any tensor is computed: the package's `__init__` calls it first thing.

`RLVR_CPU_KERNELS=native` keeps the processor's own kernels (faster on some machines, then not reproducible on
others). GPU kernels are untouched.
"""

from __future__ import annotations

import logging
import os
import platform
import sys

log = logging.getLogger(__name__)

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SWITCH = "RLVR_CPU_KERNELS"


def has_avx2() -> bool:
    """Whether this processor has AVX2 (Linux's /proc/cpuinfo; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def pin_cpu_kernels() -> dict[str, str]:
    """Set the environment that pins the CPU kernels (`PINNED`) and return it; {} where they stay the processor's
    own: `RLVR_CPU_KERNELS=native`, a processor that is not x86-64, or one without AVX2."""
    if os.environ.get(SWITCH, "avx2") == "native" or platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    if not has_avx2():
        return {}
    os.environ.update(PINNED)
    if "torch" in sys.modules:  # imported first: ATen may have chosen its kernels already
        import torch

        if torch.backends.cpu.get_cpu_capability() != "AVX2":
            log.warning(
                "this process computed with PyTorch before importing rlvr_lightning, so its CPU kernels stay the "
                "processor's own (%s) and its numbers may differ from another machine's; import rlvr_lightning first",
                torch.backends.cpu.get_cpu_capability(),
            )
    return dict(PINNED)
