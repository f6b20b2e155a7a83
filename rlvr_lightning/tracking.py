"""MLflow tracking: Lightning's `MLFlowLogger` with what a resumed run needs.

A run killed after its last checkpoint and resumed from it trains the steps between the checkpoint and
the kill again, and would log them again: MLflow appends metric points and has no API to remove one,
so every chart would show two points for those steps. This logger, continuing an existing run, keeps
what that run already holds and logs each metric only at steps past its last logged one (what W&B does
with a resumed run's earlier steps). A resume is exact on a deterministic setup (tests/test_resume.py),
so the points kept are the ones the resumed run would have logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger(__name__)


class MLFlowLogger(LightningMLFlowLogger):
    """`lightning.pytorch.loggers.MLFlowLogger`, same arguments; given a `run_id` (the CLI sets it when
    resuming from a checkpoint), metric points at steps the run already has are not logged again."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._continues_run = self._run_id is not None
        self._last_logged: dict[str, int] = {}  # metric → its last step already in the run
        self._told_about_skipping = False

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._continues_run:
            step_or_0 = step or 0  # what the parent logs for step=None
            fresh = {k: v for k, v in metrics.items() if step_or_0 > self._last_logged_step(k)}
            if len(fresh) < len(metrics) and not self._told_about_skipping:
                self._told_about_skipping = True
                log.info("resumed MLflow run %s already holds step %d: its metric points there are kept, "
                         "not logged again", self._run_id, step_or_0)  # fmt: skip
            metrics = fresh
        if metrics:
            super().log_metrics(metrics, step)

    def _last_logged_step(self, key: str) -> int:
        if key not in self._last_logged:
            history = self.experiment.get_metric_history(self._run_id, self._prefixed(key))
            self._last_logged[key] = max((m.step for m in history), default=-1)
        return self._last_logged[key]

    def _prefixed(self, key: str) -> str:
        return f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key
