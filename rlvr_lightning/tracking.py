"""MLflow tracking: Lightning's `MLFlowLogger` with what a resumed run needs, in an experiment the
MLflow UI opens on its model-training views.

MLflow 3 opens on its GenAI pages (traces, an assistant panel), where a training run's table and charts
are a toggle away. Experiments are tagged with MLflow's kind for model training, but MLflow 3.17's UI
still opens an experiment clicked in its list on the GenAI overview until the browser has switched to
"Model training" once; so `make ui` and every run's summary print direct links into the model-training
runs view (`ui_link`, `python -m rlvr_lightning.tracking`).

A run killed after its last checkpoint and resumed from it trains the steps between the checkpoint and
the kill again, and would log them again: MLflow appends metric points and has no API to remove one,
so every chart would show two points for those steps. This logger, continuing an existing run, keeps
what that run already holds and logs each metric only at steps past its last logged one (what W&B does
with a resumed run's earlier steps). A resume is exact on a deterministic setup (tests/e2e/test_stream_resume.py),
so the points kept are the ones the resumed run would have logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import contextmanager

from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from rlvr_lightning.errors import ConfigError, error_chain

log = logging.getLogger(__name__)


class TrackingStoreUnavailable(RuntimeError):
    """The tracking store refused metric points for longer than its bound: the message names the store."""


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a tracking store that is unavailable raises: MLflow's own error (a locked SQLite file, a server's
    refusal), or the connection's."""
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)


def root_cause(err: BaseException) -> str:
    """The first line of the innermost error behind `err` (SQLite's "database or disk is full", not SQLAlchemy's
    advice about autoflush that wraps it), at most 300 characters."""
    inner = list(error_chain(err))[-1]
    orig = getattr(inner, "orig", None)  # SQLAlchemy keeps the driver's own error there
    inner = orig if isinstance(orig, BaseException) else inner
    return (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]


def open_store(tracking_uri: str | None):
    """An MlflowClient on `tracking_uri` whose store exists: a new SQLite store is created by one process at a
    time (`run_lock.serialised`), and a store that cannot be opened or written (a read-only directory) is a
    one-line ConfigError naming it and the cause, before the run starts."""
    from mlflow.tracking import MlflowClient

    from rlvr_lightning.run_lock import serialised

    path = tracking_uri.removeprefix("sqlite:///") if tracking_uri and tracking_uri.startswith("sqlite:///") else None
    try:
        if path is None:
            return MlflowClient(tracking_uri=tracking_uri)
        with serialised(path), _quiet("mlflow.store.db.utils", "alembic"):
            client = MlflowClient(tracking_uri=tracking_uri)  # creates the store and runs its migrations, if new
            if os.path.exists(path) and not os.access(path, os.W_OK) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
                raise PermissionError(f"{path} or its directory is read-only")
    except Exception as err:  # MLflow's, SQLAlchemy's or the file system's: any store that cannot be opened
        raise ConfigError(
            f"trainer.logger: the tracking store {tracking_uri} cannot be opened for writing ({root_cause(err)}); "
            "make it writable or point trainer.logger.init_args.tracking_uri elsewhere"
        ) from err
    return client


@contextmanager
def _quiet(*loggers: str):
    """Those loggers' INFO lines (a new store's "Creating initial MLflow database tables...") left out."""
    levels = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # the UI's "Model training" views


def ensure_experiment(client, name: str, artifact_location: str | None = None) -> str:
    """The id of the active experiment `name`, created if missing; tagged as model training either way."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None or experiment.lifecycle_stage == "deleted":
        return client.create_experiment(name, artifact_location=artifact_location, tags=EXPERIMENT_KIND)
    for key, value in EXPERIMENT_KIND.items():
        if experiment.tags.get(key) != value:
            client.set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def ui_link(experiment_id: str, run_id: str | None = None, base: str = "http://127.0.0.1:5000") -> str:
    """Where `make ui` shows an experiment's runs (or one run) in its model-training views."""
    path = f"runs/{run_id}" if run_id else "runs"
    return f"{base}/#/experiments/{experiment_id}/{path}?workflowType=machine_learning"


class MLFlowLogger(LightningMLFlowLogger):
    """`lightning.pytorch.loggers.MLFlowLogger`, same arguments, plus:

    - given a `run_id` (the CLI sets it when resuming from a checkpoint), metric points at steps the run
      already has are not logged again;
    - MLflow's system metrics (CPU, memory, disk, network; GPU utilisation and memory where there is
      one) every `system_metrics_interval_s` seconds while the run is open, from rank 0's node, under
      `system/…` (the run's "System metrics" tab); `system_metrics=False` turns them off;
    - a run stopped by a signal (`stopped_by`) is closed as KILLED, tagged `stopped` with the line saying where;
    - a tracking store that refuses points (a locked SQLite file, a server restarting) does not stop training:
      the points are kept and sent again, in order, with the next step's, and at the end; one that has refused
      them for `store_unavailable_s` is an error naming the store (`TrackingStoreUnavailable`).
    """

    def __init__(
        self,
        *args,
        system_metrics: bool = True,
        system_metrics_interval_s: float = 10.0,
        store_unavailable_s: float = 600.0,
        **kwargs,
    ) -> None:
        if rank_zero_only.rank == 0:  # the one process that logs opens its store first (creating it, if new)
            uri = kwargs.get("tracking_uri", os.getenv("MLFLOW_TRACKING_URI"))
            open_store(uri or f"file:{kwargs.get('save_dir', './mlruns')}")
        super().__init__(*args, **kwargs)
        self.store_unavailable_s = store_unavailable_s
        self._pending: list[tuple[dict, int | None]] = []  # points the store refused, oldest first
        self._refused_since: float | None = None
        self._continues_run = self._run_id is not None
        self._last_logged: dict[str, int] = {}  # metric → its last step already in the run
        self._told_about_skipping = False
        self._system_metrics_interval_s = system_metrics_interval_s if system_metrics else None
        self._system_monitor = None
        self.stopped_by: str | None = None  # a signal stopped the run (`callbacks/stopping.py`): the line saying so

    @property
    @rank_zero_experiment
    def experiment(self):
        if not self._initialized and self._run_id is None and self._experiment_id is None:
            self._experiment_id = ensure_experiment(self._mlflow_client, self._experiment_name, self._artifact_location)
        client = super().experiment
        if self._system_metrics_interval_s and self._system_monitor is None:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self._run_id,
                sampling_interval=self._system_metrics_interval_s,
                tracking_uri=self._tracking_uri,
                resume_logging=self._continues_run,  # a resumed run's system metrics continue its steps
            )
            self._system_monitor.start()
        return client

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        self._flush_at_end()
        if self._system_monitor is not None:
            self._system_monitor.finish()  # flushes its last samples while the run is still open
            self._system_monitor = None
        if self.stopped_by is not None and self._initialized:  # stopped on purpose: not a failure
            self.experiment.set_tag(self.run_id, "stopped", self.stopped_by)
            status = "KILLED"
        super().finalize(status)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._continues_run:
            step_or_0 = step or 0  # what the parent logs for step=None
            fresh = {k: v for k, v in metrics.items() if step_or_0 > self._last_logged_step(k)}
            if len(fresh) < len(metrics) and not self._told_about_skipping:
                self._told_about_skipping = True
                log.info(
                    "resumed MLflow run %s already holds step %d: its metric points there are kept, not logged again",
                    self._run_id,
                    step_or_0,
                )
            metrics = fresh
        if metrics:
            self._pending.append((dict(metrics), step))
        self._send_pending()

    def _send_pending(self) -> None:
        """Send the points the store has not taken yet, oldest first; stop at the first refusal."""
        import time

        while self._pending:
            metrics, step = self._pending[0]
            try:
                LightningMLFlowLogger.log_metrics(self, metrics, step)
            except _store_errors() as err:
                now = time.monotonic()
                if self._refused_since is None:
                    self._refused_since = now
                first = root_cause(err)
                if now - self._refused_since > self.store_unavailable_s:
                    raise TrackingStoreUnavailable(
                        f"the tracking store {self._tracking_uri} has refused metric points for "
                        f"{now - self._refused_since:.0f} s (trainer.logger.init_args.store_unavailable_s = "
                        f"{self.store_unavailable_s:g}; last: {first}); {len(self._pending)} steps' points were not "
                        "logged"
                    ) from err
                log.warning("the tracking store refused metric points (%s); %d steps' points kept, sent again with "
                            "the next step's", first, len(self._pending))  # fmt: skip
                return
            self._pending.pop(0)
            self._refused_since = None

    def _flush_at_end(self) -> None:
        """The points still refused when the run ends: sent again until the store takes them or its bound."""
        import time

        while self._pending:
            self._send_pending()
            if self._pending:
                time.sleep(1.0)

    def _last_logged_step(self, key: str) -> int:
        if key not in self._last_logged:
            history = self.experiment.get_metric_history(self._run_id, self._prefixed(key))
            self._last_logged[key] = max((m.step for m in history), default=-1)
        return self._last_logged[key]

    def _prefixed(self, key: str) -> str:
        return f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key


def print_ui_links(tracking_uri: str, base: str) -> None:
    """What `make ui` prints: the model-training runs view of every experiment in the store."""
    import os

    path = tracking_uri.removeprefix("sqlite:///")
    experiments = []
    if not tracking_uri.startswith("sqlite:///") or os.path.exists(path):  # do not create an empty store
        import mlflow

        client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
        experiments = [e for e in client.search_experiments() if e.name != "Default"]
    print(f"MLflow UI at {base} (model-training views; each run's closing summary prints its own link):")
    for e in experiments:
        print(f"  {e.name}: {ui_link(e.experiment_id, base=base)}")
    if not experiments:
        print(f"  no runs yet: {base}/#/experiments?workflowType=machine_learning")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Print the MLflow UI's model-training links for a store.")
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--base", default="http://127.0.0.1:5000")
    args = parser.parse_args()
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "creating tables" notices
    print_ui_links(args.tracking_uri, args.base)
