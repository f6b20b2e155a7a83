"""The run's watchdog: no run sits idle unseen.

If no training step finishes within its bound, the watchdog writes every thread's stack and the state of the
rollout (the engine's replicas, the stream generating ahead, the verifier's and the sandbox's pools: whatever
has a `describe()`) to the log and to the MLflow run (`watchdog/stall.txt`), then stops the run with an error
saying so. The bound (`--watchdog.*`; printed when training starts): the first step may take `first_step_s`
(engines start, kernels compile); each later one `stall_s` if set, else ten times the longest step so far, at
least `MIN_STALL_S`. Bounding each wait where it happens names the wait (a replica, a request, a rank); the
watchdog is the last line, for a wait nothing else bounds.

Stopping: the watchdog's thread signals the main thread (`STALL_SIGNAL`, a real-time signal: SIGUSR1 is SLURM's
requeue signal under Lightning), whose handler raises `RunStalled` there: a
wait in Python (a lock, a socket, a sleep) is interrupted by it and the run unwinds as from any error, closing
its engines and pools. A wait inside native code may not return; if the run has not ended `EXIT_GRACE_S` later,
the process exits (its launched servers follow it: they get SIGTERM when their parent dies).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback

import lightning as L

from rlvr_lightning.callbacks.rank_watch import (
    ENDED_BY_ERROR,
    ENDED_NORMALLY,
    heartbeat_interval_s,
    lost_rank_line,
    mark_ended,
    silent_peer,
    start_sentinel,
)
from rlvr_lightning.errors import RESUME_HINT, RunStalled

log = logging.getLogger(__name__)

MIN_STALL_S = 600.0
EXIT_GRACE_S = 60.0
STALL_EXIT_CODE = 3
STALL_SIGNAL = signal.SIGRTMIN + 4  # no one else sends it (glibc keeps the ones below SIGRTMIN, Lightning and SLURM use SIGUSR1/2)


def thread_stacks() -> str:
    """Every thread's stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def rollout_state(trainer: L.Trainer, module) -> str:
    """What the run's pieces say about themselves (`describe()`): the engine, the stream, each callback."""
    parts = []
    session = getattr(module, "session", None)
    if session is not None:
        parts.append(f"policy version: {session.policy_version}")
        for name, obj in session.built().items():
            if obj is not None:
                describe = getattr(obj, "describe", None)
                parts.append(f"{name}: {describe() if describe else type(obj).__name__}")
    scoring = getattr(module, "scoring", None)
    if scoring is not None:
        parts.append(f"scoring: {scoring.describe()}")
    for cb in trainer.callbacks:
        describe = getattr(cb, "describe", None)
        if describe is not None:
            parts.append(f"{type(cb).__name__}: {describe()}")
    return "\n".join(parts) or "(nothing to describe)"


class Watchdog(L.Callback):
    def __init__(
        self,
        enabled: bool = True,
        stall_s: float | None = None,
        first_step_s: float = 1800.0,
        rank_unresponsive_s: float = 60.0,
    ) -> None:
        """Every argument is a CLI flag, `--watchdog.<name>`.

        Args:
            enabled: watch the run (false: a stalled run waits as long as its waits' own bounds).
            stall_s: how long a training step may take before the run is taken for stalled (None: ten times the
                longest step so far, at least 600 s).
            first_step_s: the same for the first step of the run (or of a resumed run), which starts the engines.
            rank_unresponsive_s: several ranks: a rank whose heartbeat has not moved for this long is taken for
                killed or frozen, and the others stop, naming it (each rank's sentinel: `rank_watch.py`).
        """
        for name, value in (("stall_s", stall_s), ("first_step_s", first_step_s),
                            ("rank_unresponsive_s", rank_unresponsive_s)):  # fmt: skip
            if value is not None and value <= 0:
                from rlvr_lightning.errors import ConfigError

                raise ConfigError(f"watchdog.{name} must be > 0 seconds, got {value}")
        self.enabled, self.stall_s, self.first_step_s = enabled, stall_s, first_step_s
        self.rank_unresponsive_s = rank_unresponsive_s
        self.sentinel = None  # several ranks: this rank's sentinel process
        self.longest_step_s = 0.0
        self.steps_seen = 0
        self._last = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler = None
        self._stalled: str | None = None

    # ---- the bound --------------------------------------------------------------------------------
    def bound_s(self) -> float:
        if self.steps_seen == 0:
            return self.first_step_s
        if self.stall_s is not None:
            return self.stall_s
        return max(MIN_STALL_S, 10 * self.longest_step_s)

    def describe_bound(self) -> str:
        later = f"{self.stall_s:g} s" if self.stall_s is not None else f"10× the longest step, at least {MIN_STALL_S:g} s"
        return f"watchdog: the first step may take {self.first_step_s:g} s, each later one {later}"

    # ---- Lightning hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("the watchdog needs the main thread; it is off for this run")
            return
        self._previous_handler = signal.signal(STALL_SIGNAL, self._raise_stalled)
        if trainer.is_global_zero:
            print(self.describe_bound(), file=sys.stderr)
        self._last = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(trainer, pl_module), name="watchdog", daemon=True)
        self._thread.start()
        if trainer.world_size > 1:
            self._rank = trainer.global_rank
            self.sentinel = start_sentinel(trainer.global_rank, trainer.world_size, self.rank_unresponsive_s)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        now = time.monotonic()
        self.longest_step_s = max(self.longest_step_s, now - self._last)
        self.steps_seen += 1
        self._last = now

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._disarm(ENDED_NORMALLY)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        watched = self.sentinel is not None
        self._disarm(ENDED_BY_ERROR)
        if watched and isinstance(exception, RuntimeError) and "Connection" in str(exception):
            # A collective fails at once when a peer's process is gone (gloo: "Connection reset by peer"), with
            # no word of which rank: the heartbeats say.
            lost = silent_peer(trainer.global_rank, trainer.world_size, heartbeat_interval_s(self.rank_unresponsive_s))
            if lost is not None:
                why = "is gone: a collective lost its connection to it and its heartbeat stopped"
                print(lost_rank_line(trainer.global_rank, lost, self.rank_unresponsive_s, why), file=sys.stderr,
                      flush=True)  # fmt: skip

    def teardown(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        self._disarm(ENDED_NORMALLY)

    def _disarm(self, how: int) -> None:
        self._stop.set()
        if self.sentinel is not None:
            mark_ended(self._rank, how)  # before the sentinel goes: the others must not take this rank for lost
            self.sentinel.terminate()
            self.sentinel.wait()
            self.sentinel = None
        if self._previous_handler is not None:
            signal.signal(STALL_SIGNAL, self._previous_handler)
            self._previous_handler = None

    # ---- the watch ---------------------------------------------------------------------------------
    def _raise_stalled(self, signum, frame) -> None:
        raise RunStalled(self._stalled or "the run stalled")

    def _watch(self, trainer: L.Trainer, module) -> None:
        while not self._stop.wait(1.0):
            waited, bound = time.monotonic() - self._last, self.bound_s()
            if waited > bound:
                setting = "watchdog.first_step_s" if self.steps_seen == 0 else "watchdog.stall_s"
                headline = (
                    f"no training step finished for {waited:.0f} s (bound {bound:g} s, {setting}) after optimizer "
                    f"step {trainer.global_step} on rank {trainer.global_rank}"
                )
                self._stop_run(trainer, module, headline, EXIT_GRACE_S)
                return

    def _stop_run(self, trainer: L.Trainer, module, headline: str, grace_s: float) -> None:
        """Write the report, raise `RunStalled` in the main thread, and exit if it has not unwound `grace_s` later
        (rank 0 first kills the ranks it launched, which may be the frozen ones)."""
        try:
            state = rollout_state(trainer, module)
        except Exception as err:  # a stalled piece may fail to describe itself: the stacks still go out
            state = f"(could not describe the rollout: {type(err).__name__}: {err})"
        text = f"{headline}\n\n== rollout ==\n{state}\n\n== threads ==\n{thread_stacks()}"
        log.error("watchdog: %s", text)
        where = self._to_mlflow(trainer, text)
        self._stalled = f"{headline}; every thread's stack and the rollout's state are in the log{where}"
        if self._stop.is_set():
            return
        signal.pthread_kill(threading.main_thread().ident, STALL_SIGNAL)
        if not self._stop.wait(grace_s):
            print(f"error: {self._stalled}; the run did not stop within {grace_s:g} s of the watchdog's signal, "
                  f"exiting. {RESUME_HINT}", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(STALL_EXIT_CODE)

    def _to_mlflow(self, trainer: L.Trainer, text: str) -> str:
        """The stall report as an artifact of the run, within a bound (the tracking store may be what hangs)."""
        logger = trainer.logger
        run_id = getattr(logger, "run_id", None)
        if run_id is None or not hasattr(logger, "experiment"):
            return ""
        done = threading.Event()

        def write() -> None:
            try:
                logger.experiment.log_text(run_id, text, "watchdog/stall.txt")
                logger.experiment.set_tag(run_id, "stalled", "true")
                done.set()
            except Exception as err:
                log.warning("watchdog: could not write the report to MLflow: %s", err)

        threading.Thread(target=write, name="watchdog-mlflow", daemon=True).start()
        return " and the MLflow run (watchdog/stall.txt)" if done.wait(30.0) else ""
