"""Command line: `python -m rlvr_lightning fit --config configs/base.yaml --config configs/algo/grpo.yaml ...`.

A LightningCLI whose model is any `RLVRModule` subclass (the algorithm), whose data is the
RolloutDataModule and whose `rollout:` section (`RolloutSettings`: sampling and the engine) is handed
to the data module (`rlvr_cli.py`). Additions over the stock CLI:
  * `--imports my_pieces` (and installed packages' `rlvr_lightning.pieces` entry points) import a user's
    piece modules before parsing, so the names they register parse (`rlvr_lightning/pieces/loading.py`);
  * `--rollout_batches`, the run's length in rollout batches, sets `trainer.max_steps` (`run_length.py`);
  * the settings left to the device resolve from the accelerator (`accelerator_defaults.py`), and the
    progress bar counts rollout batches (`default_progress_bar.py`);
  * the MLflow run is named after the preset and the pieces it changes (`run_naming.py`), and tagged with
    algorithm, preset, pieces, model and dataset; a run resumed from a checkpoint logs into the run that
    wrote it (`mlflow_resume.py`);
  * the resolved config is logged to MLflow (flattened params + `config.yaml` artifact) instead of
    being written to a log directory, which the MLflow logger does not have (`config_logging.py`).
User errors (bad config values, data files, model paths) print one clear line, no usage and no traceback
(`error_lines.py`; an unknown option's closest valid ones: `option_hints.py`).
"""

from __future__ import annotations

import logging
import sys

from rlvr_lightning.cli.error_lines import user_error_behind
from rlvr_lightning.cli.rlvr_cli import RLVRCLI
from rlvr_lightning.errors import RESUME_HINT, RunStalled, RunStopped, error_chain
from rlvr_lightning.rollout.server_process import RolloutServerLost
from rlvr_lightning.run_lock import release_run_directory
from rlvr_lightning.tracking import TrackingStoreUnavailable


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        RLVRCLI(args=argv)
    except Exception as err:
        stopped = next((e for e in error_chain(err) if isinstance(e, RunStopped)), None)
        if stopped is not None:  # on purpose (SIGTERM, SIGINT): the line says where, and which checkpoint
            print(stopped, file=sys.stderr, flush=True)
            sys.exit(stopped.exit_code)
        user_error = user_error_behind(err)
        if user_error is None:
            raise
        resume = ""
        if isinstance(user_error, RolloutServerLost | RunStalled | TrackingStoreUnavailable):
            resume = f" {RESUME_HINT}"
        print(f"error: {user_error}{resume}", file=sys.stderr)
        sys.exit(2)
    finally:
        release_run_directory()  # the run is over (`main` called from Python goes on)
