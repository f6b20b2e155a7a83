"""The watchdog over a real Lightning fit logging to a real MLflow store: a step that never ends stops the run
within the bound with `RunStalled`, every thread's stack in the log and in the MLflow run, and a run whose steps
keep finishing is left alone."""

from __future__ import annotations

import threading
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from rlvr_lightning.callbacks.watchdog import Watchdog
from rlvr_lightning.errors import ConfigError, RunStalled
from rlvr_lightning.tracking import MLFlowLogger


class Stalling(L.LightningModule):
    """Trains a scalar; step `stall_at` waits on an event nobody sets (a frozen generation)."""

    def __init__(self, stall_at: int | None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.stall_at = stall_at

    def training_step(self, batch, index):
        if index == self.stall_at:
            wait_for_a_generation_that_never_comes()
        return (self.w - batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def wait_for_a_generation_that_never_comes() -> None:
    threading.Event().wait()


def fit(tmp_path, module: L.LightningModule, watchdog: Watchdog, steps: int = 6):
    logger = MLFlowLogger(experiment_name="watchdog", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                          artifact_location=str(tmp_path / "artifacts"))  # fmt: skip
    trainer = L.Trainer(max_steps=steps, logger=logger, callbacks=[watchdog], accelerator="cpu",
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, DataLoader(torch.ones(64, 1), batch_size=1))
    return logger


def test_a_step_that_never_ends_stops_the_run_with_the_stacks_in_the_log_and_mlflow(tmp_path, caplog, capsys):
    watchdog = Watchdog(stall_s=2.0, first_step_s=30.0)
    start = time.monotonic()
    with pytest.raises(RunStalled, match=r"no training step finished for \d+ s \(bound 2 s, watchdog.stall_s\) after optimizer step 3 on rank 0.*MLflow run \(watchdog/stall.txt\)"):  # fmt: skip
        fit(tmp_path, Stalling(stall_at=3), watchdog)
    assert time.monotonic() - start < 30
    assert "the first step may take 30 s, each later one 2 s" in capsys.readouterr().err  # printed at start
    assert "wait_for_a_generation_that_never_comes" in caplog.text  # the main thread's stack, in the log
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("watchdog").experiment_id])
    report = open(client.download_artifacts(run.info.run_id, "watchdog/stall.txt", str(tmp_path))).read()
    assert "--- thread MainThread" in report and "wait_for_a_generation_that_never_comes" in report
    assert run.data.tags["stalled"] == "true"
    assert threading.current_thread() is threading.main_thread()  # the test goes on: the handler was restored


def test_the_first_step_has_its_own_bound(tmp_path):
    with pytest.raises(RunStalled, match=r"bound 2 s, watchdog.first_step_s\) after optimizer step 0"):
        fit(tmp_path, Stalling(stall_at=0), Watchdog(stall_s=60.0, first_step_s=2.0))


def test_a_run_whose_steps_finish_is_left_alone_and_the_bound_follows_the_longest_step(tmp_path):
    watchdog = Watchdog(first_step_s=30.0)
    fit(tmp_path, Stalling(stall_at=None), watchdog, steps=4)
    assert watchdog.steps_seen == 4 and watchdog.bound_s() == 600.0  # 10× the longest step, at least 600 s
    watchdog.longest_step_s = 120.0
    assert watchdog.bound_s() == 1200.0


def test_bounds_must_be_positive():
    with pytest.raises(ConfigError, match="watchdog.stall_s must be > 0 seconds"):
        Watchdog(stall_s=0)
