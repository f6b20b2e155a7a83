"""For a parse error about an unknown option, the valid options it most resembles."""

from __future__ import annotations

import re

import rlvr_lightning.algos
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.models.lora import LoraSettings
from rlvr_lightning.planner.settings import PlanSettings
from rlvr_lightning.rollout.settings import RolloutSettings, ServerSettings, StreamSettings, SyncSettings
from rlvr_lightning.training.settings import BehaviourSettings, ComputeSettings, OptimSettings

# The settings groups of the module and of `rollout:`, each a section of its own here (`model.optim.lr`).
GROUPS = {
    "model.optim": OptimSettings,
    "model.compute": ComputeSettings,
    "model.behaviour": BehaviourSettings,
    "model.lora": LoraSettings,
    "rollout.servers": ServerSettings,
    "rollout.stream": StreamSettings,
    "rollout.sync": SyncSettings,
}
# Options that moved into a group under another name (`rollout.server_urls` → `rollout.servers.urls`); one that
# kept its name in its group (`rollout.max_staleness`) is found by its name.
RENAMED = {
    **{f"server_{name}": f"rollout.servers.{name}" for name in ServerSettings.__dataclass_fields__},
    "stream_mode": "rollout.stream.mode",
    "sync_check_tol": "rollout.sync.check_tol",
    "sync_check_every": "rollout.sync.check_every",
}
# Lightning's own optimizer options, which the CLI leaves out (`auto_configure_optimizers=False`).
LIGHTNING_OPTIMIZER = re.compile(r"unrecognized arguments: --(optimizer|lr_scheduler)\b")
# How jsonargparse names an unknown option: (section, [group,] option).
UNKNOWN = (
    re.compile(r"(\w+): Option '(\w+)' is not accepted"),
    re.compile(r"(\w+): Group '(\w+)' does not accept option '(\w+)'"),
    re.compile(r"(\w+): unrecognized arguments: --(\w+)\.(\w+)"),
    re.compile(r"unrecognized arguments: --(\w+)\.(?:init_args\.)?(?:(\w+)\.)?(\w+)"),
    # A section's option in a config file (`rollout: {server_urls: …}`), with the `fit` subcommand or without.
    re.compile(r"^Subcommand '\w+' does not accept option '(\w+)\.(?:init_args\.)?(?:(\w+)\.)?(\w+)'"),
    re.compile(r"^Group '(\w+)' does not accept option '(?:(\w+)\.)?(\w+)'"),
)


def known_options() -> dict[str, set[str]]:
    """The options of each section, read from the signatures that LightningCLI reads (`model`: every
    algorithm's arguments; `model.optim` and the other groups: their fields)."""
    import dataclasses
    import inspect

    import lightning as L

    def names(*callables) -> set[str]:
        return {p for c in callables for p in inspect.signature(c).parameters if p not in ("self", "args", "kwargs")}

    algorithms = [getattr(rlvr_lightning.algos, n) for n in rlvr_lightning.algos.__all__]
    groups = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in GROUPS.items()}
    return {
        "model": names(*algorithms),
        **groups,
        "data": names(RolloutDataModule),
        "rollout": names(RolloutSettings),
        "trainer": names(L.Trainer),
        "plan": names(PlanSettings),
    }


def option_hint(line: str) -> str:
    """For a parse error about an unknown option, the valid options it most resembles: the same name in
    another section (`data.group_size` → `rollout.group_size`, `model.lr` → `model.optim.lr`), or its new name
    (`rollout.stream_mode` → `rollout.stream.mode`), else the closest names in its own."""
    import difflib

    if (moved := piece_hint(line)) is not None:
        return moved
    if LIGHTNING_OPTIMIZER.search(line):
        return ("; the algorithm makes its own AdamW and schedule: model.init_args.optim.lr, .weight_decay, "
                ".warmup_steps, .lr_schedule, .max_grad_norm")  # fmt: skip
    found = unknown_option(line)
    if found is None:
        return ""
    section, name = found
    options = known_options()
    if section not in options:
        return ""
    same = [f"{other}.{name}" for other, names in options.items() if other != section and name in names]
    if name in RENAMED:
        same.insert(0, RENAMED[name])
    close = same or [f"{section}.{n}" for n in difflib.get_close_matches(name, sorted(options[section]), n=3)]
    return f"; did you mean {' or '.join(map(flag_of, close))}?" if close else "; every option with its value: --print_config"


def unknown_option(line: str) -> tuple[str, str] | None:
    """(its section, the option) of a parse error about an unknown option (`("model.optim", "lrr")`), else None."""
    found = next((m for m in (p.search(line) for p in UNKNOWN) if m is not None), None)
    if found is None:
        return None
    *path, name = [part for part in found.groups() if part]
    return ".".join(path), name


def files_setting(line: str, args: list[str]) -> list[str]:
    """The config files given with `--config` in `args` that set the unknown option of a parse error (none: a flag
    set it, or the error is of another kind). jsonargparse names the option and its group but not the file."""
    import yaml

    found = unknown_option(line)
    if found is None:
        return []
    wanted = ".".join(found)
    files = [a.split("=", 1)[1] if "=" in a else b  # in the command line's order; `-c` is LightningCLI's alias
             for a, b in zip(args, [*args[1:], ""]) if a in ("--config", "-c") or a.startswith(("--config=", "-c="))]
    hits = []
    for name in files:
        try:
            with open(name) as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):  # not a file (a YAML string), or one jsonargparse reports itself
            continue
        if wanted in set(dotted_keys(loaded)):
            hits.append(name)
    return hits


def dotted_keys(tree, prefix: str = ""):
    """Each key path of a parsed config file, dotted, without `init_args` and a leading subcommand (`fit`): the
    option's path as a parse error names it."""
    if not isinstance(tree, dict):
        return
    for key, value in tree.items():
        if key == "init_args" or (not prefix and key == "fit"):
            yield from dotted_keys(value, prefix)
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path
        yield from dotted_keys(value, path)


def flag_of(option: str) -> str:
    """An option as `known_options` names it, spelt as a flag (less its `--`) and a config file's path spell it: the
    algorithm's sit under `init_args` (`model.optim.lr` → `model.init_args.optim.lr`)."""
    return "model.init_args." + option.removeprefix("model.") if option.startswith("model.") else option


# How jsonargparse names a piece given as a bare name (`policy_loss: gspo`), and a flat option of the model.
BARE_PIECE = re.compile(r'model\.(\w+)\.\1: Unable to load config "([^"]+)"')
# (An option with a mapping value is named with its first key: `piece_args: {pass_at_k: 2}` is 'piece_args.pass_at_k'.)
MODEL_OPTION = re.compile(r"model: (?:Option '|unrecognized arguments: --)(\w+)(?:\.[\w.]*)?(?:' is not accepted|[= ]|$)")


def piece_hint(line: str) -> str | None:
    """The new spelling of a piece's old one: a bare name is `….policy_loss.name gspo`, a knob sits in its
    piece's section (`….policy_loss.knobs.clip_eps_high`), and `piece_args` is gone; None for other errors."""
    from rlvr_lightning.pieces import KINDS

    if (bare := BARE_PIECE.search(line)) is not None and bare.group(1) in {r.key for r in KINDS}:
        return f"; a piece is chosen by name: --model.init_args.{bare.group(1)}.name {bare.group(2)}"
    if (flat := MODEL_OPTION.search(line)) is None:
        return None
    knob = flat.group(1)
    if knob == "piece_args":
        return "; a piece's knobs are set in its own section: --model.init_args.<kind>.knobs.<knob> (docs/pieces.md)"
    kinds = [r.key for r in KINDS if any(knob in piece.knobs for piece in r.pieces())]
    if not kinds:
        return None
    return f"; {knob} is a knob of a piece, set in its section: " + " or ".join(f"--model.init_args.{k}.knobs.{knob}" for k in kinds)
