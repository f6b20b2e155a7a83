"""Resuming from a checkpoint applies what the user says.

The checkpoint is read once, by the project, before anything else (`read_resume_point`): a file that is not a
checkpoint of this project (missing, empty, truncated, random bytes, a directory that is no sharded checkpoint)
is one line. The run's settings are the ones this command line gives: Lightning's CLI would lay the
checkpoint's saved hyper-parameters over them (a resume with `--model.init_args.kl_coef 0.5` trained on with the
checkpoint's 0.001); here each setting that differs from the checkpoint's is printed and recorded in the MLflow
run (a `resumed` tag per resume), and a change that cannot be honoured is one line: another algorithm class,
another model (here), weights of another shape (`RLVRModule.on_load_checkpoint`, e.g. another LoRA rank).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlvr_lightning import checkpoint_record
from rlvr_lightning.errors import ConfigError


@dataclass(frozen=True)
class ResumePoint:
    path: str
    algorithm: str | None  # the checkpoint's algorithm class (its `_class_path`); None: a sharded checkpoint
    hparams: dict = field(default_factory=dict)  # its saved hyper-parameters, `_class_path` left out
    run_id: str | None = None  # the MLflow run that wrote it
    rollout_batches: int | None = None  # the rollout batches it holds
    model: str | None = None  # the model it was trained from (`data.model_name_or_path`)


def read_resume_point(path: str) -> ResumePoint:
    """The checkpoint at `path`, read once (memory-mapped: the weights stay on disk), or a one-line ConfigError."""
    import torch

    where = Path(path)
    if not where.exists():
        raise ConfigError(f"ckpt_path: no checkpoint at {path}")
    if where.is_dir():  # a sharded checkpoint: PyTorch's distributed checkpoint, its record names the run
        if not (where / ".metadata").exists():
            raise ConfigError(f"ckpt_path: {path} is a directory but not a sharded checkpoint (no .metadata in it)")
        entry = checkpoint_record.verify(path) or checkpoint_record.read(where.parent) or {}
        return ResumePoint(path, None, {}, entry.get("mlflow_run_id"), entry.get("rollout_batches"))
    if where.stat().st_size == 0:
        raise ConfigError(f"ckpt_path: {path} is empty, not a checkpoint")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"ckpt_path: {path} is not a checkpoint this project can read ({reason})") from None
    if not isinstance(state, dict) or "state_dict" not in state or "hyper_parameters" not in state:
        raise ConfigError(f"ckpt_path: {path} is a PyTorch file but not a checkpoint of an rlvr_lightning run")
    checkpoint_record.verify(path)
    hparams = dict(state["hyper_parameters"])
    algorithm = hparams.pop("_class_path", None)
    hparams.pop("_instantiator", None)
    rlvr, data = state.get("rlvr") or {}, state.get("datamodule_hyper_parameters") or {}
    model = data.get("model_name_or_path")
    return ResumePoint(path, algorithm, hparams, rlvr.get("mlflow_run_id"), rlvr.get("rollout_batches"), model)


def settings_changed(
    point: ResumePoint, model_cfg, model_name_or_path: str | None = None
) -> list[tuple[str, object, object]]:
    """(setting, the checkpoint's value, this command line's) for each model setting that differs; a
    ConfigError for another algorithm class or another model, which a checkpoint cannot be resumed as."""
    from rlvr_lightning.cli.config_logging import flatten_config

    if point.model is not None and model_name_or_path is not None and point.model != model_name_or_path:
        raise ConfigError(
            f"ckpt_path: {point.path} was trained from the model {point.model}, and this command line gives "
            f"data.model_name_or_path={model_name_or_path}: a run resumes on the model it was trained from (give "
            "that one, or start a new run)"
        )
    if point.algorithm is None:
        return []
    if point.algorithm != model_cfg.class_path:
        saved, wanted = point.algorithm.rpartition(".")[2], model_cfg.class_path.rpartition(".")[2]
        raise ConfigError(
            f"ckpt_path: {point.path} is a checkpoint of a {saved} run, and this command line selects {wanted}: a run "
            f"resumes as the algorithm it was (resume with its own ALGO, or start a new run for {wanted})"
        )
    saved = flatten_config(point.hparams, "model.init_args.")
    given = flatten_config(model_cfg.init_args.as_dict(), "model.init_args.")
    plain = lambda v: json.dumps(v, sort_keys=True, default=str)  # noqa: E731  (a tuple and a list alike)
    return [(k, saved.get(k), given.get(k)) for k in sorted(set(saved) | set(given))
            if plain(saved.get(k)) != plain(given.get(k))]  # fmt: skip


def describe_changes(changes: list[tuple[str, object, object]]) -> str:
    return "; ".join(f"{k}: {old!r} → {new!r}" for k, old, new in changes)
