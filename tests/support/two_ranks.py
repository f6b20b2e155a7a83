"""Run a function on 2 spawned CPU processes that form a gloo group, and collect what each returns."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

from rlvr_lightning.rollout.loopback import free_port


def run_two_ranks(fn, *args, timeout_s: float = 120) -> dict:
    """`fn(rank, port, *args, out)` on ranks 0 and 1, each writing its result to `out[rank]`; fails the
    test if they do not finish within `timeout_s` (a hang means their collectives fell out of step)."""
    with mp.Manager() as manager:
        out = manager.dict()
        ctx = mp.spawn(fn, args=(free_port(), *args, out), nprocs=2, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=2):  # True once both ranks have exited (raises if one failed)
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                pytest.fail(f"the two ranks did not finish within {timeout_s:.0f} s (collectives out of step)")
        return dict(out)
