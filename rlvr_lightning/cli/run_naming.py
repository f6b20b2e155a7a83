"""The MLflow run's default name and its tags: the preset's name, followed by the pieces the run changes and the
parts it adds (a reward function, an environment, the tool, a teacher, an advantage shaper)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser, Namespace

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.callbacks.summary import pieces_run
from rlvr_lightning.rewards.settings import MATH_VERIFY, RewardSettings
from rlvr_lightning.shapers.settings import ShaperSettings


def run_identity(cfg: Namespace) -> tuple[str, dict[str, str]]:
    """The run's default name and its tags. The name is the preset's (the last `--config` file that names the
    algorithm class: configs/algo/grpo.yaml → `grpo`), followed by `+<key>=<piece>` for each piece the run
    uses that differs from what the preset alone selects (`grpo+policy_loss=my_loss`), and by `+model=<Class>`
    first when `--model` changed the class. So a run is never taken for its preset's unless it ran the
    preset's pieces. Without a preset file the class's name in lower case is the preset and its defaults the
    reference. Then `+<key>=<value>` for each part the run adds to its preset's (`run_parts`:
    `grpo+reward=boxed_bonus`, `grpo+env=HigherLower`; `<key>=none` for one it leaves out). Tags: `algorithm` (the
    class), `preset`, `piece.<key>` for each piece the run uses (`kl_estimator` only with a KL term), `parts` (every
    part the run has, `reward=boxed_bonus+tool=python`) and `changes` (what the name adds to the preset's)."""
    model = cfg.model
    algorithm = model.class_path.rsplit(".", 1)[-1]
    preset = preset_of(cfg.get("config") or [])
    name, reference, preset_data = preset if preset else (algorithm.lower(), {"class_path": model.class_path}, {})
    reference = resolved_model(reference)
    if reference.init_args.rollout_correction.name is None:  # left to the device, as the run resolved it
        reference.init_args.rollout_correction = model.init_args.rollout_correction
    changed = [f"model={algorithm}"] if reference.class_path != model.class_path else []
    tags, preset_pieces = {"algorithm": algorithm, "preset": name}, pieces_run(reference.init_args, every_kind=True)
    for key, piece in pieces_run(model.init_args).items():
        tags[f"piece.{key}"] = piece
        if piece != preset_pieces.get(key):  # a piece only the run has (distillation's `opd_reward`) is a change
            changed.append(f"{key}={piece}")
    parts = run_parts(model.init_args.as_dict(), cfg.get("data"))
    changed += changed_parts(run_parts(reference.init_args.as_dict(), preset_data), parts)
    if parts:
        tags["parts"] = "+".join(f"{key}={value}" for key, value in parts)
    if changed:
        tags["changes"] = "+".join(changed)
    return "+".join([name, *changed]), tags


def run_parts(model_args: Mapping[str, Any], data: Any) -> list[tuple[str, str]]:
    """What a run adds to its pieces, as (key, value) in a fixed order: its source of correctness when not
    math-verify's, each reward function's term, each advantage shaper, its environment or Python tool, its teacher.
    `model_args`: the `model:` section's init_args; `data`: its `data:` section (a Namespace or a dict), or None."""
    rewards, shapers = RewardSettings.of(model_args.get("rewards")), ShaperSettings.of(model_args.get("shapers"))
    parts = [] if rewards.correctness == MATH_VERIFY else [("correctness", rewards.correctness.rpartition(".")[2])]
    parts += [("reward", f.term) for f in rewards.functions]
    parts += [("shaper", key) for key in ("thr", "oar") if getattr(shapers, key) is not None]
    parts += [("shaper", c.name.rpartition(".")[2]) for c in shapers.custom]
    data = data.as_dict() if isinstance(data, Namespace) else dict(data or {})
    environment = data.get("environment")
    if environment:
        class_path = environment.get("class_path", "") if isinstance(environment, Mapping) else str(environment)
        parts.append(("env", class_path.rpartition(".")[2]))
    if data.get("tool"):
        parts.append(("tool", "python"))
    teacher = model_args.get("teacher")
    if teacher:
        parts.append(("teacher", Path(str(teacher["model_name_or_path"])).name))
    return parts


def changed_parts(preset: list[tuple[str, str]], run: list[tuple[str, str]]) -> list[str]:
    """`key=value` for each part the run has and its preset has not, and `key=none` for a kind of part the preset has
    and the run has none of (the `thr` preset with `--model.init_args.shapers '{thr: null}'`: `thr+shaper=none`)."""
    added = [f"{key}={value}" for key, value in run if (key, value) not in preset]
    kept = {key for key, _ in run}
    dropped = [f"{key}=none" for key in dict.fromkeys(key for key, _ in preset) if key not in kept]
    return added + dropped


def preset_of(config_files: list) -> tuple[str, dict, dict] | None:
    """(name, `model:` section, `data:` section) of the last config file that names the algorithm class
    (`model.class_path`)."""
    for path in reversed(config_files):
        try:
            cfg = yaml.safe_load(path.get_content()) if hasattr(path, "get_content") else None
        except (OSError, yaml.YAMLError):
            continue
        section = cfg.get("model") if isinstance(cfg, dict) else None
        if isinstance(section, dict) and section.get("class_path"):
            return Path(str(path)).stem, section, cfg.get("data") or {}
    return None


def resolved_model(section: dict) -> Namespace:
    """A `model:` section with the class's defaults filled in, as the CLI resolves it."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(RLVRModule, "model", required=True)
    return parser.parse_object({"model": section}).model
