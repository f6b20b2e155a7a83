"""Defaults that fit the device: the settings a user did not give resolve from the accelerator the run uses.

One pure function, `resolve_device_defaults(accelerator, given, ...)`, decides every such value, and every
reader goes through it: `make train` (the CLI, before anything is built), `make plan` (for the hardware it
plans for), `make doctor`, and a `RolloutSettings` or algorithm module built directly in Python. A value a
user sets (`given`, anything but None) always wins.

On the CPU (and any accelerator other than CUDA) the values are exactly the ones this project always ran
with, so CPU runs stay bit-identical. On CUDA they are the fast ones:

- `rollout.dtype` bfloat16 (float16 on a card without bf16) and `rollout.enforce_eager` false (CUDA graphs:
  a decode step costs vLLM roughly 1–5 ms instead of 10–20 ms eager);
- bf16 compute with fp32 master weights: `trainer.precision` bf16-mixed (autocast), or, under FSDP2, FSDP2's
  own MixedPrecisionPolicy (`model.compute.fsdp_param_dtype` bfloat16: bf16 all-gathers and compute, fp32 gradient
  reduction and sharded masters) with `trainer.precision` 32-true, so that bf16 is applied once, not by
  autocast on top of bf16 parameters. A bf16 or fp16 precision the user chooses under FSDP2 keeps the
  parameters fp32 for the same reason. A card without bf16 trains in fp32 (fp16 training needs a loss
  scaler, which the update does not run);
- `rollout.gpu_memory_utilization`: see `gpu_memory_share`;
- `model.compute.packing` (padding-free micro-batches) on;
- `model.rollout_correction.name` `icepop`: a bf16 engine beside an fp32-master trainer samples from a measurably
  different distribution, and the update would train on it uncorrected; IcePop's two-sided token band masks the
  tokens the two disagree on most (TRL and prime-rl mask by default too). Not where it cannot apply: a group-level
  loss (REAL's), or truncated sampling (top-p/top-k), whose engine log-probs are not the policy's
  (`correction_fits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# The settings that resolve from the device, in the order the start-up block prints them.
KEYS = (
    "trainer.precision",
    "model.compute.fsdp_param_dtype",
    "model.compute.packing",
    "model.rollout_correction.name",
    "rollout.dtype",
    "rollout.enforce_eager",
    "rollout.gpu_memory_utilization",
)
# What every run had before the defaults followed the device; still every non-CUDA device's.
CPU_DEFAULTS: dict[str, Any] = {
    "trainer.precision": "32-true",
    "model.compute.fsdp_param_dtype": "float32",
    "model.compute.packing": False,
    "model.rollout_correction.name": "none",
    "rollout.dtype": "float32",
    "rollout.enforce_eager": True,
    "rollout.gpu_memory_utilization": 0.3,  # unused off a GPU; kept as it was
}
# vLLM's share of a GPU it shares with the trainer. Awake through the update (sleep_level 0) it holds its
# share while the trainer needs its weights, gradients, AdamW state (16 bytes per parameter in fp32) and
# activations: 0.3, TRL's default for its colocated engine. Asleep during the update (sleep_level ≥ 1) its
# share comes back for the update, and what binds is generation, where the trainer still keeps its fp32
# weights and AdamW state (12 bytes per parameter): 0.5, verl's default with sleep mode, leaves ~40 GiB of
# an 80 GB card to them (a full fine-tune of up to ~3B parameters on one GPU). On GPUs the trainer does not
# use (`rollout.servers.cuda_devices`, `servers.urls`) the engine is alone: vLLM's own default, 0.9. These
# are constants, not a plan: `make train` plans the run before it starts and refuses one that will not fit,
# naming the change that does (docs/planning.md).
SHARE_AWAKE, SHARE_ASLEEP, SHARE_ALONE = 0.3, 0.5, 0.9


@dataclass(frozen=True)
class Accelerator:
    """What a run's defaults depend on: the accelerator's kind (`cuda`, `cpu`, `mps`, …) and bf16 support."""

    kind: str
    bf16: bool = False

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return f"{self.kind}{', bf16' if self.is_cuda and self.bf16 else ''}"


def cuda_accelerator() -> Accelerator:
    import torch

    return Accelerator("cuda", bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()))


def detect_accelerator(flag: object = "auto") -> Accelerator:
    """The accelerator `trainer.accelerator` = `flag` selects on this machine: `auto` is CUDA where there is
    a GPU (as Lightning picks), `gpu`/`cuda` CUDA, `cpu` the CPU; any other kind keeps its name."""
    import torch

    name = str(flag if isinstance(flag, str) else getattr(flag, "class_path", flag) or "auto").lower()
    if name in ("gpu", "cuda") or name.endswith("cudaaccelerator") or (name == "auto" and torch.cuda.is_available()):
        return cuda_accelerator()
    return Accelerator("cpu" if name in ("auto", "cpu") or name.endswith("cpuaccelerator") else name)


def accelerator_of_device(device) -> Accelerator:
    """The accelerator of a `torch.device` (a module's, once the trainer placed it)."""
    return cuda_accelerator() if device.type == "cuda" else Accelerator(device.type)


def gpu_memory_share(sleep_level: int, engine_elsewhere: bool) -> float:
    """vLLM's `gpu_memory_utilization` on CUDA (see SHARE_AWAKE, SHARE_ASLEEP, SHARE_ALONE for why)."""
    if engine_elsewhere:
        return SHARE_ALONE
    return SHARE_ASLEEP if sleep_level > 0 else SHARE_AWAKE


def cuda_defaults(
    bf16: bool, given: Mapping[str, Any], fsdp: bool, sleep_level: int, engine_elsewhere: bool, correction_fits: bool = True
) -> dict[str, Any]:
    half = "bfloat16" if bf16 else "float16"
    precision = given.get("trainer.precision")
    user_half_precision = precision is not None and str(precision).startswith(("bf16", "16"))
    fsdp_bf16 = bf16 and not user_half_precision  # FSDP2 computes in bf16 unless the user's precision already does
    fsdp_param_dtype = given.get("model.compute.fsdp_param_dtype") or ("bfloat16" if fsdp_bf16 else "float32")
    if not bf16 or (fsdp and fsdp_param_dtype == "bfloat16"):
        trainer_precision = "32-true"  # fp32 (no bf16), or bf16 from FSDP2's policy: not autocast again
    else:
        trainer_precision = "bf16-mixed"
    return {
        "trainer.precision": trainer_precision,
        "model.compute.fsdp_param_dtype": fsdp_param_dtype,
        "model.compute.packing": True,
        "model.rollout_correction.name": "icepop" if correction_fits else "none",
        "rollout.dtype": half,
        "rollout.enforce_eager": False,
        "rollout.gpu_memory_utilization": gpu_memory_share(sleep_level, engine_elsewhere),
    }


@dataclass(frozen=True)
class DeviceDefaults:
    """The resolved values of `KEYS`, and which of them the device chose (the rest the user set)."""

    accelerator: Accelerator
    values: dict[str, Any]
    from_device: frozenset[str]
    keys: tuple[str, ...] = KEYS  # the settings the run has (`model.compute.packing` only for a module that has it)

    def source(self, key: str) -> str:
        return f"device default ({self.accelerator.kind})" if key in self.from_device else "your config"

    def section(self, name: str) -> dict[str, Any]:
        """The resolved values of one config section (`model`, `rollout`, `trainer`), by option name (a
        group's as `group.option`: `compute.packing`)."""
        return {key.split(".", 1)[1]: self.values[key] for key in self.keys if key.startswith(f"{name}.")}

    def block(self) -> str:
        """What `make train` prints once at start."""
        lines = [f"settings that follow the device ({self.accelerator}):"]
        for key in self.keys:
            value = str(self.values[key]).lower() if isinstance(self.values[key], bool) else self.values[key]
            lines.append(f"  {key:<32} {value!s:<11} from: {self.source(key)}")
        return "\n".join(lines)

    def params(self) -> dict[str, str]:
        """MLflow params beside the values themselves: where each came from."""
        return {
            "device_defaults.accelerator": str(self.accelerator),
            **{f"device_defaults.{key}": self.source(key) for key in self.keys},
        }


def resolve_device_defaults(
    accelerator: Accelerator,
    given: Mapping[str, Any],
    fsdp: bool = False,
    sleep_level: int = 0,
    engine_elsewhere: bool = False,
    correction_fits: bool = True,
) -> DeviceDefaults:
    """Every value of `KEYS`: the one in `given` where it is not None (the user's), else the device's default.

    `fsdp` (the FSDP2 strategy), `sleep_level` and `engine_elsewhere` (rollout servers on GPUs the trainer does
    not use) are what else the user set that a CUDA default depends on; `correction_fits`: a token-level rollout
    correction applies to the run (its loss is token-level and it samples the untruncated distribution)."""
    unknown = set(given) - set(KEYS)
    if unknown:
        raise ValueError(f"resolve_device_defaults: not a device-defaulted setting: {', '.join(sorted(unknown))}")
    if accelerator.is_cuda:
        device = cuda_defaults(accelerator.bf16, given, fsdp, sleep_level, engine_elsewhere, correction_fits)
    else:
        device = dict(CPU_DEFAULTS)
    chosen = {key: device[key] if given.get(key) is None else given[key] for key in KEYS}
    return DeviceDefaults(accelerator, chosen, frozenset(k for k in KEYS if given.get(k) is None))


def default_for(key: str, accelerator: Accelerator | None = None, **context: Any) -> Any:
    """One setting's default where nothing else is known (a module or `RolloutSettings` built in Python):
    on this machine's accelerator unless one is given."""
    return resolve_device_defaults(accelerator or detect_accelerator(), {}, **context).values[key]


# ---- the glue: a parsed `make train` configuration (a jsonargparse Namespace, or the same as a dict) ------
def _section(cfg, key: str):
    """(the namespace holding `key`'s option, its name), None where this configuration has no such option."""
    *path, name = key.split(".")
    if path[0] == "model":  # the module's arguments: model.init_args.<group>.<name>
        path.insert(1, "init_args")
    node = cfg
    for part in path:
        node = node.get(part) if hasattr(node, "get") else None
    return (node, name) if hasattr(node, "get") and name in node else None


def config_keys(cfg) -> tuple[str, ...]:
    """The device-defaulted settings this configuration has (`model.compute.packing` only for a module that has it)."""
    return tuple(key for key in KEYS if _section(cfg, key) is not None)


def uses_fsdp2(cfg) -> bool:
    strategy = cfg.trainer.strategy
    return str(strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")).endswith("FSDP2Strategy")


def config_device_defaults(cfg, accelerator: Accelerator, correction_fits: bool = True) -> DeviceDefaults:
    """The resolution of a parsed configuration: what it sets wins, the rest follows `accelerator`
    (`correction_fits`: see `resolve_device_defaults`; the caller reads it off the configuration's pieces)."""
    given = {}
    for key in config_keys(cfg):
        node, name = _section(cfg, key)
        given[key] = node[name]
    rollout = cfg.rollout
    defaults = resolve_device_defaults(
        accelerator,
        given,
        fsdp=uses_fsdp2(cfg),
        sleep_level=int(rollout.sleep_level or 0),
        engine_elsewhere=bool(rollout.servers.urls or rollout.servers.cuda_devices),
        correction_fits=correction_fits,
    )
    return replace(defaults, keys=tuple(given))


def apply_to_config(cfg, defaults: DeviceDefaults) -> None:
    """Write the resolved values into the configuration, so that everything built from it, and the config
    MLflow records, carries them."""
    for key in config_keys(cfg):
        node, name = _section(cfg, key)
        node[name] = defaults.values[key]
