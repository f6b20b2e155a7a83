"""A fake world of ranks in one process, for running every rank's part of FSDP2 on fake tensors."""

from __future__ import annotations

from contextlib import contextmanager


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
