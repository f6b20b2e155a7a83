"""A table of training completions in MLflow: every `every_n_steps` rollout batches, a few whole groups of the batch
the step trained on, one row per answer with its prompt, gold, completion (the model's turns and what an environment
inserted between them), finish reason, correctness, each reward term, the reward and its advantage. Logged with
MLflow's `log_table` as `samples/train_step_<N>.json`, beside the held-out samples (`samples/val_step_<N>.json`), so
the run's artifact view shows it as a table; the same answers' token view (`callbacks.token_view`) as
`samples/tokens_step_<N>.html`; and each of them as a trace in the run's Traces tab (`callbacks.episode_traces`).
Written by a background thread, off the step's critical path."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_warn

from rlvr_lightning.callbacks.answer_rows import answer_columns, table_of
from rlvr_lightning.callbacks.episode_traces import log_episode_traces, point_tracing_at
from rlvr_lightning.callbacks.token_view import token_answers, token_view_html
from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.errors import ConfigError

_UNSET = object()


def logged_rows(batch: ScoredBatch, groups: int) -> range:
    """The answers of the first `groups` whole groups of a scored batch (all of them in a smaller batch)."""
    return range(min(groups * batch.group_size, batch.rollout.num_sequences))


def completion_rows(batch: ScoredBatch, groups: int, decode, max_chars: int, step: int) -> dict[str, list]:
    """The table of the first `groups` groups of a scored batch: one row per answer, with its reward and advantage."""
    rollout = batch.rollout
    return table_of([
        {"step": step, "group": rollout.group_of(n), **answer_columns(rollout, n, decode, max_chars),
         "reward": float(batch.rewards[n]), "advantage": float(batch.advantages[n])}
        for n in logged_rows(batch, groups)
    ])  # fmt: skip


class CompletionsTable(Callback):
    def __init__(
        self, every_n_steps: int = 10, groups: int = 2, max_chars: int = 4000, token_view: bool = True,
        traced_groups: int = 1,
    ) -> None:  # fmt: skip
        """
        Args:
            every_n_steps: log the completions of every n-th rollout batch (the first one included); 0: never.
            groups: whole groups of the batch per table (rows: groups × rollout.group_size).
            max_chars: a longer prompt, completion, code or output keeps its first `max_chars` characters.
            token_view: also log the same answers' token view (`samples/tokens_step_<N>.html`).
            traced_groups: of those groups, how many to log as MLflow traces of the run, an answer each (its turns,
                tool calls and score); 0: none. MLflow stores a trace in ~30 ms of CPU on a small machine, so the
                default keeps to one group (bench/completions_overhead.py).
        """
        if every_n_steps < 0 or groups < 1 or max_chars < 1 or traced_groups < 0:
            raise ConfigError("CompletionsTable needs every_n_steps ≥ 0, groups ≥ 1, max_chars ≥ 1 and traced_groups ≥ 0")
        self.every_n_steps, self.groups, self.max_chars, self.token_view = every_n_steps, groups, max_chars, token_view
        self.traced_groups = traced_groups
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._tracing = False  # a trace was started: MLflow exports them in the background, flushed at the end
        # The process's tracking URI before traces were pointed at the run's store, restored at the end; `_UNSET`
        # where it was not moved (no trace yet, or it was the run's store already).
        self._uri_before: str | None | object = _UNSET

    def logs(self, rollout_batch: int) -> bool:
        """Whether rollout batch `rollout_batch` (0-based) is one this table logs."""
        return bool(self.every_n_steps) and rollout_batch % self.every_n_steps == 0

    def entropy_groups(self, rollout_batch: int) -> int:
        """The groups of rollout batch `rollout_batch` whose per-token entropy its token view shows (the step keeps
        it: `StepContext.entropy_groups`); 0 where it logs no token view."""
        return self.groups if self.token_view and self.logs(rollout_batch) else 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs, batch, batch_idx: int) -> None:
        step = pl_module.rollout_batches - 1  # the rollout batch just trained (`training_step` counted it)
        result = getattr(pl_module, "last_result", None)  # an `RLVRModule`'s; another module has none
        batch_result = getattr(result, "batch", None)  # None: a skipped batch (DAPO's)
        logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        if not self.logs(step) or batch_result is None or logger is None:
            return
        if trainer.global_rank != 0:
            return
        tokenizer = trainer.datamodule.tokenizer
        table = completion_rows(batch_result, self.groups, tokenizer.decode, self.max_chars, step)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="completions-table")
        experiment, run_id = logger.experiment, logger.run_id
        self._pending = self._unfinished()
        self._pending.append(self._writer.submit(experiment.log_table, run_id, data=table,
                                                 artifact_file=f"samples/train_step_{step:06d}.json"))  # fmt: skip
        rows = logged_rows(batch_result, self.groups)
        if self.token_view:
            self._pending.append(self._writer.submit(log_token_view, experiment, run_id, result, rows, tokenizer.decode, step))
        if self.traced_groups:
            if not self._tracing:
                import mlflow

                self._tracing = True
                if mlflow.get_tracking_uri() != experiment.tracking_uri:  # moving it resets MLflow's tracing settings
                    self._uri_before = point_tracing_at(experiment.tracking_uri)
            traced = logged_rows(batch_result, min(self.groups, self.traced_groups))
            self._pending.append(self._writer.submit(log_episode_traces, experiment, logger.experiment_id, run_id,
                                                     batch_result, traced, tokenizer.decode, step, self.max_chars))  # fmt: skip

    def _unfinished(self) -> list[Future]:
        """The writes still running; each finished one that failed is reported (a warning, never the run's error)."""
        for future in self._pending:  # a table is a view of the run: losing one must not fail it
            if future.done() and (err := future.exception()) is not None:
                rank_zero_warn(f"CompletionsTable: a table could not be logged ({type(err).__name__}: {err})")
        return [f for f in self._pending if not f.done()]

    def teardown(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        self.finish()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.finish()  # a failed or stopped fit skips `teardown`: its tables and traces are written all the same

    def finish(self) -> None:
        """Wait for the tables and traces still being written (one that failed is a warning, never the run's error),
        then give the process its own tracking URI back."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._pending = self._unfinished()  # every write has finished: each one that failed is reported
        if self._tracing:
            import mlflow

            mlflow.flush_trace_async_logging()  # the traces MLflow's exporter still holds reach the store now
            self._tracing = False
        if self._uri_before is not _UNSET:
            point_tracing_at(self._uri_before)  # type: ignore[arg-type]
            self._uri_before = _UNSET


def log_token_view(experiment, run_id: str, result, rows, decode, step: int) -> None:
    """The token view of the answers `rows` of a trained batch, as the artifact `samples/tokens_step_<N>.html`."""
    page = token_view_html(token_answers(result, rows, decode), f"Rollout batch {step}: tokens of {len(rows)} answers")
    experiment.log_text(run_id, page, artifact_file=f"samples/tokens_step_{step:06d}.html")
