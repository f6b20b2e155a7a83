"""CPU runs take one kernel path whatever the processor or the environment says (`rlvr_lightning.cpu_kernels`):
ATen's kernel selection set to `default` (no vectorisation) or to `avx2` trains the same weights, bit for bit,
where with the processor's own kernels (`RLVR_CPU_KERNELS=native`) the two differ."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlvr_lightning.cpu_kernels import PINNED, has_avx2
from tests.support.cli import REPO

pytestmark = pytest.mark.skipif(not has_avx2(), reason="CPU kernels are pinned on x86-64 processors with AVX2 only")


def trained(**env: str) -> tuple[str, str]:
    """(ATen's kernel selection, digest of the weights) of a 12-step warm start in a process with `env`."""
    base = {k: v for k, v in os.environ.items() if k not in (*PINNED, "RLVR_CPU_KERNELS")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.kernel_probe", "12"], cwd=REPO, env={**base, **env},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    capability, digest = out.stdout.split()[-2:]
    return capability, digest


def test_the_trainers_numbers_do_not_follow_the_kernel_selection():
    pinned = {trained(ATEN_CPU_CAPABILITY=selection) for selection in ("default", "avx2")}
    assert len(pinned) == 1 and next(iter(pinned))[0] == "AVX2", pinned
    native = trained(ATEN_CPU_CAPABILITY="default", RLVR_CPU_KERNELS="native")
    assert native[0] == "DEFAULT"
    assert native[1] != next(iter(pinned))[1]  # the selection changes the numbers where nothing pins it
