"""The MLflow run's default name and its tags: the preset's name, followed by the pieces the run changes."""

from __future__ import annotations

from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, Namespace

from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.callbacks.summary import pieces_run


def run_identity(cfg: Namespace) -> tuple[str, dict[str, str]]:
    """The run's default name and its tags. The name is the preset's (the last `--config` file that names the
    algorithm class: configs/algo/grpo.yaml → `grpo`), followed by `+<key>=<piece>` for each piece the run
    uses that differs from what the preset alone selects (`grpo+policy_loss=my_loss`), and by `+model=<Class>`
    first when `--model` changed the class. So a run is never taken for its preset's unless it ran the
    preset's pieces. Without a preset file the class's name in lower case is the preset and its defaults the
    reference. Tags: `algorithm` (the class), `preset`, `piece.<key>` for each piece the run uses
    (`kl_estimator` only with a KL term), and `changed_pieces` (`policy_loss=my_loss+…`) when some differ."""
    model = cfg.model
    algorithm = model.class_path.rsplit(".", 1)[-1]
    preset = preset_of(cfg.get("config") or [])
    name, reference = preset if preset else (algorithm.lower(), {"class_path": model.class_path})
    reference = resolved_model(reference)
    if reference.init_args.rollout_correction.name is None:  # left to the device, as the run resolved it
        reference.init_args.rollout_correction = model.init_args.rollout_correction
    changed = [f"model={algorithm}"] if reference.class_path != model.class_path else []
    tags, preset_pieces = {"algorithm": algorithm, "preset": name}, pieces_run(reference.init_args, every_kind=True)
    for key, piece in pieces_run(model.init_args).items():
        tags[f"piece.{key}"] = piece
        if piece != preset_pieces[key]:
            changed.append(f"{key}={piece}")
    if changed:
        tags["changed_pieces"] = "+".join(changed)
    return "+".join([name, *changed]), tags


def preset_of(config_files: list) -> tuple[str, dict] | None:
    """(name, `model:` section) of the last config file that names the algorithm class (`model.class_path`)."""
    for path in reversed(config_files):
        try:
            cfg = yaml.safe_load(path.get_content()) if hasattr(path, "get_content") else None
        except (OSError, yaml.YAMLError):
            continue
        section = cfg.get("model") if isinstance(cfg, dict) else None
        if isinstance(section, dict) and section.get("class_path"):
            return Path(str(path)).stem, section
    return None


def resolved_model(section: dict) -> Namespace:
    """A `model:` section with the class's defaults filled in, as the CLI resolves it."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(RLVRModule, "model", required=True)
    return parser.parse_object({"model": section}).model
