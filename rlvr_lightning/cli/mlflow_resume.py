"""A run resumed from a checkpoint logs into the MLflow run that wrote it, when this tracking store holds it."""

from __future__ import annotations

import logging

from jsonargparse import Namespace

from rlvr_lightning.cli.checkpoint_resume import ResumePoint


def reopen_checkpoint_run(point: ResumePoint, logger_args: Namespace) -> None:
    """The MLFlowLogger's `run_id` set to the run that wrote the checkpoint, if this store has it; else a warning,
    and the run logs to a new one."""
    run_id = point.run_id
    if run_id and mlflow_run_exists(logger_args.tracking_uri, run_id):
        logger_args.run_id = run_id
    elif run_id:
        logging.getLogger(__name__).warning(
            "checkpoint %s was written by MLflow run %s, which %s does not hold; logging to a new run",
            point.path,
            run_id,
            logger_args.tracking_uri,
        )


def mlflow_run_exists(tracking_uri: str | None, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    from rlvr_lightning.tracking import open_store

    try:
        open_store(tracking_uri).get_run(run_id)
        return True
    except MlflowException:
        return False
