"""A run resumed from a checkpoint logs into the MLflow run that wrote it, when this tracking store holds it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jsonargparse import Namespace

from rlvr_lightning.errors import ConfigError


def reopen_checkpoint_run(ckpt_path: str, logger_args: Namespace) -> None:
    """The MLFlowLogger's `run_id` set to the run that wrote the checkpoint, if this store has it; else a warning,
    and the run logs to a new one."""
    run_id = checkpoint_run_id(ckpt_path)
    if run_id and mlflow_run_exists(logger_args.tracking_uri, run_id):
        logger_args.run_id = run_id
    elif run_id:
        logging.getLogger(__name__).warning(
            "checkpoint %s was written by MLflow run %s, which %s does not hold; logging to a new run",
            ckpt_path,
            run_id,
            logger_args.tracking_uri,
        )


def checkpoint_run_id(path: str) -> str | None:
    """The MLflow run a checkpoint was written by (None: start a new run)."""
    import torch

    if not Path(path).exists():
        raise ConfigError(f"ckpt_path: no checkpoint at {path}")
    if Path(path).is_dir():  # a sharded checkpoint: its `last.json` sidecar names the run
        sidecar = Path(path).parent / "last.json"
        return json.loads(sidecar.read_text()).get("mlflow_run_id") if sidecar.exists() else None
    try:  # mmap: only the small metadata is read, not the weights
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:
        raise ConfigError(f"ckpt_path: cannot read checkpoint {path} ({type(err).__name__}: {err})") from None
    return (state.get("rlvr") or {}).get("mlflow_run_id")


def mlflow_run_exists(tracking_uri: str | None, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
        return True
    except MlflowException:
        return False
