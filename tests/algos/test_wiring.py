"""What the module hands Lightning and takes from it (`algos.wiring`): the callbacks every run adds, and the end
of a rollout batch: its metrics written to the loggers at once, and a skipped batch that asks to stop the run."""

from __future__ import annotations

from types import SimpleNamespace

from rlvr_lightning.algos import wiring
from rlvr_lightning.callbacks.closing import CloseOnError
from rlvr_lightning.training.step import Skipped


def test_every_run_closes_its_engines_on_an_error():
    assert [type(c) for c in wiring.default_callbacks(SimpleNamespace(callbacks=[]))] == [CloseOnError]


class Logger:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics, step):
        self.logged.append((metrics, step))


def module_at(rollout_batches: int, should_stop: bool = False):
    kept: list[dict] = []
    return SimpleNamespace(
        trainer=SimpleNamespace(should_stop=should_stop), loggers=[Logger()], session=None, latest_val={},
        rollout_batches=rollout_batches, log_dict=lambda metrics, **kw: kept.append(metrics), kept=kept,
    )  # fmt: skip


def test_a_skipped_batch_is_logged_at_its_index_and_may_stop_the_run():
    module = module_at(4)
    wiring.finish_rollout_batch(module, Skipped({"dynamic_sampling_rounds": 3.0}, stop_run=True), prompts=8)
    assert module.loggers[0].logged == [({"train/dynamic_sampling_rounds": 3.0}, 4)]  # written now, at batch 4
    assert module.kept == [{"train/dynamic_sampling_rounds": 3.0}] and module.trainer.should_stop
    going_on = module_at(5)
    wiring.finish_rollout_batch(going_on, Skipped({"dynamic_sampling_rounds": 1.0}), prompts=8)
    assert not going_on.trainer.should_stop
    stopping = module_at(6, should_stop=True)  # already stopping (a signal): a batch does not undo it
    wiring.finish_rollout_batch(stopping, Skipped({}), prompts=8)
    assert stopping.trainer.should_stop and stopping.loggers[0].logged == []  # nothing to log
