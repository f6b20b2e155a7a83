"""Stopping a run on a signal without losing a step.

SIGTERM (SLURM's preemption, `docker stop`, `kill`) and SIGINT (Ctrl-C) stop the run at the end of the rollout
batch in progress: a checkpoint is written there, the MLflow run is closed as KILLED with a `stopped` tag, one
line names the batch, the checkpoint and how to resume, and the process exits with the shell's code for the
signal (143, 130). Lightning's own SIGTERM handling ends the run with exit code 0 and no checkpoint; this
replaces it for the run's length.

Under SLURM with Lightning's auto-requeue (`SLURMEnvironment(auto_requeue=True)`, the default there), its
requeue signal (SIGUSR1 unless set otherwise) stops the run the same way and then requeues the job; the
requeued job resumes from the checkpoint (`slurm_requeue.py`).

Bounded: a batch that has not ended `grace_s` after the signal (a step waiting on a frozen replica, a long
generation) is interrupted as the watchdog interrupts a stalled one (the signal again, now raising in the main
thread), and the run stops at its last checkpoint, saying so; a second signal does the same at once. A run
still there `EXIT_GRACE_S` later (a wait inside native code) exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment

from rlvr_lightning.errors import ConfigError, RunStopped
from rlvr_lightning.slurm_requeue import requeue

EXIT_GRACE_S = 30.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(L.Callback):
    def __init__(self, grace_s: float = 120.0) -> None:
        """Every argument is a CLI flag, `--stop.<name>`.

        Args:
            grace_s: how long after SIGTERM or SIGINT the rollout batch in progress may take to end, with a
                checkpoint, before it is interrupted and the run stops at its last checkpoint.
        """
        if not grace_s > 0:
            raise ConfigError(f"stop.grace_s must be > 0 seconds, got {grace_s}")
        self.grace_s = grace_s
        self.received: int | None = None  # the signal that stops the run
        self._bound_passed = False
        self._previous: dict[int, object] = {}
        self._ended = threading.Event()
        self._trainer: L.Trainer | None = None
        self.requeue_signal: int | None = None  # SLURM's, when Lightning's auto-requeue is on (`slurm_requeue.py`)

    # ---- Lightning hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._trainer = trainer
        self._ended.clear()
        # The environment Lightning's own signal handling reads (a single-device strategy does not expose it).
        environment = getattr(trainer.strategy, "cluster_environment", None) or trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            self.requeue_signal = environment.requeue_signal  # Lightning's requeue signal, with our checkpoint
        # Over Lightning's handlers (SIGTERM: the run ends with exit code 0; requeue: a checkpoint saved mid-step).
        for sig in (*SIGNALS, self.requeue_signal) if self.requeue_signal else SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, *args) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:  # every rank stops at the same batch, and writes its part of the checkpoint
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        checkpoint = self._checkpoint_at(trainer, pl_module)
        batch = pl_module.rollout_batches
        where = f"checkpoint {checkpoint} holds it" if checkpoint else "its checkpoint could not be written"
        self._stop(trainer, f"at the end of rollout batch {batch}: {where}", checkpoint)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        self._restore()

    # ---- the stop ----------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signum
            then = ", then the SLURM job is requeued" if signum == self.requeue_signal else ""
            print(f"received {name}: the run stops at the end of this rollout batch, with a checkpoint there{then} "
                  f"(within {self.grace_s:g} s; {name} again stops it at once)", file=sys.stderr, flush=True)  # fmt: skip
            threading.Thread(target=self._bound, name="stop-on-signal", daemon=True).start()
            return
        # A second signal, or the bound passing: stop where the run is, at its last checkpoint.
        trainer = self._trainer
        last = self._last_checkpoint(trainer) if trainer is not None else None
        held = f"the last checkpoint {last[0]} holds rollout batch {last[1]}" if last else "no checkpoint was written"
        why = f"the batch did not end within {self.grace_s:g} s" if self._bound_passed else "a second signal"
        self._stop(trainer, f"before the rollout batch in progress ended ({why}): {held}", last[0] if last else None)

    def _bound(self) -> None:
        if self._ended.wait(self.grace_s):
            return
        self._bound_passed = True
        signal.pthread_kill(threading.main_thread().ident, self.received)  # raises in the main thread
        if not self._ended.wait(EXIT_GRACE_S):
            name = signal.Signals(self.received).name
            print(f"error: stopped by {name}: the run did not unwind within {EXIT_GRACE_S:g} s of being interrupted, "
                  "exiting; resume from its last checkpoint", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(128 + self.received)

    def _stop(self, trainer: L.Trainer | None, where: str, checkpoint) -> None:
        self._ended.set()
        name = signal.Signals(self.received).name
        resume = f"; continue it with `make train RESUME={checkpoint}` (the same ALGO and ARGS)" if checkpoint else ""
        if self.received == self.requeue_signal and (trainer is None or trainer.is_global_zero):
            resume = f"; {requeue()}, to resume from its last checkpoint"
        line = f"stopped by {name} {where}{resume}"
        for logger in trainer.loggers if trainer is not None else ():
            if hasattr(logger, "stopped_by"):
                logger.stopped_by = line  # closes the MLflow run as KILLED, tagged with the line
        raise RunStopped(line, 128 + self.received)

    @staticmethod
    def _saver(trainer: L.Trainer):
        """The run's checkpoint callback, if it has one."""
        from rlvr_lightning.callbacks.checkpoint import ResumableCheckpoint

        return next((c for c in trainer.callbacks if isinstance(c, ResumableCheckpoint)), None)

    def _checkpoint_at(self, trainer: L.Trainer, pl_module):
        """The checkpoint of this batch: the one the checkpoint callback just wrote, or one written now."""
        saver = self._saver(trainer)
        if saver is None:
            return None
        if saver.saved_at == pl_module.rollout_batches:
            return saver.run_dir(trainer) / "last.ckpt"
        return saver.save(trainer, pl_module)

    def _last_checkpoint(self, trainer: L.Trainer):
        saver = self._saver(trainer)
        return saver.last_saved(trainer) if saver is not None else None

    def _restore(self) -> None:
        self._ended.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
