"""The settings a user left to the device (`rlvr_lightning.device_defaults`), resolved from the accelerator
`trainer.accelerator` selects into the config itself, and printed once."""

from __future__ import annotations

from jsonargparse import Namespace

from rlvr_lightning.device_defaults import DeviceDefaults, apply_to_config, config_device_defaults, detect_accelerator
from rlvr_lightning.training.settings import config_correction_fits


def apply_device_defaults(cfg: Namespace) -> DeviceDefaults:
    """The device-defaulted settings resolved and written into `cfg`; printed by the first rank only."""
    accelerator = detect_accelerator(cfg.trainer.accelerator)
    device_defaults = config_device_defaults(cfg, accelerator, config_correction_fits(cfg))
    apply_to_config(cfg, device_defaults)
    if not spawned_rank():
        print(device_defaults.block(), flush=True)
        if (line := sandbox_line(cfg)) is not None:
            print(line, flush=True)
    return device_defaults


def sandbox_line(cfg: Namespace) -> str | None:
    """Where the run has the Python tool: which bound holds a call's memory in its sandbox (a cgroup per call,
    or each process's address space), under the device block."""
    tool = getattr(getattr(cfg, "data", None), "tool", None)
    if tool is None:
        return None
    from rlvr_lightning.sandbox import memory_line

    return f"  {'tool sandbox memory':<32} {memory_line(tool.sandbox)}"


def spawned_rank() -> bool:
    """A process Lightning's launcher (or torchrun, SLURM) started for a rank other than the first: the first
    one prints what every rank shares."""
    import os

    return any(int(os.environ.get(name, "0") or 0) > 0 for name in ("LOCAL_RANK", "NODE_RANK", "RANK"))
