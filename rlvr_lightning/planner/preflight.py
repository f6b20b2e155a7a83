"""`make train` plans its run before building anything heavy: on a GPU it refuses a run predicted not
to fit, in one error naming the predicted peak, the device's memory and the first change that fits; on
the CPU it warns when the prediction exceeds the memory available. `--plan.check false` skips it."""

from __future__ import annotations

import logging
import os

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.hardware import Hardware, hardware
from rlvr_lightning.planner.planner import Plan, plan_run, plan_with_fixes
from rlvr_lightning.planner.run_spec import run_spec

log = logging.getLogger(__name__)


def machine_hardware(name: str | None, device_gib: float | None) -> Hardware:
    """The hardware `plan:` names, else this machine's: its GPU (memory as CUDA reports it; the peaks of the
    listed GPU it names, or an H100's) or the CPU."""
    import dataclasses

    import torch

    if name is None:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            label = props.name.lower().replace(" ", "")
            known = next((k for k in ("h200", "h100", "l40s", "a100") if k in label), "h100")
            known = {"a100": "a100-80g" if props.total_memory > 50 * 1024**3 else "a100-40g"}.get(known, known)
            hw = dataclasses.replace(hardware(known), memory_gib=props.total_memory / 1024**3)
        else:
            hw = hardware("cpu")
    else:
        hw = hardware(name)
    return dataclasses.replace(hw, memory_gib=device_gib) if device_gib else hw


def plan_config(cfg, with_fixes: bool = False, estimate_time: bool = True) -> Plan:
    settings = cfg.plan
    spec = run_spec(cfg, machine_hardware(settings.hardware, settings.device_gib))
    return plan_with_fixes(spec) if with_fixes else plan_run(spec, estimate_time)


def _spawned_by_lightning() -> bool:
    """A rank Lightning's launcher started (it sets LOCAL_RANK for its children, torchrun also sets
    TORCHELASTIC_RUN_ID): the launching process planned the run already."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


def preflight(cfg) -> None:
    """Plan the run `cfg` configures; refuse (GPU) or warn (CPU) when it is predicted not to fit."""
    if not cfg.plan.check or _spawned_by_lightning():
        return
    try:
        plan = plan_config(cfg, estimate_time=False)
    except Exception as err:  # the plan never stops a run it cannot reason about: the run's own checks speak
        log.warning("plan: could not plan this run (%s: %s); training without the memory check", type(err).__name__, err)
        return
    summary = f"predicted peak {plan.peak_gib:.1f} GiB per rank ({plan.peak_stage}) against {plan.device_gib:.1f} GiB"
    if plan.fits:
        log.info("plan: %s: fits", summary)
        return
    if not plan.spec.hardware.gpu:
        log.warning("plan: %s available on this machine: the run may swap or be killed (`make plan` shows why)", summary)
        return
    fixed = plan_with_fixes(plan.spec, estimate_time=False)  # the refusal needs no step time: no FLOP-counting run
    first = f"; the first change that fits: {fixed.fixes[0][0]}" if fixed.fixes else ""
    raise ConfigError(f"plan: {summary}: the run will not fit{first} (`make plan` shows the breakdown; --plan.check false skips this check)")
