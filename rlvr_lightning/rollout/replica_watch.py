"""Health checks of the `vllm serve` replicas while a run uses them: a frozen replica (a stopped process, a
wedged host) answers neither its requests nor `/health`, so a request to it would wait out its whole bound.

A daemon thread GETs each replica's `/health` every `interval_s`; a replica that has not answered one for
`unresponsive_s` (`rollout.servers.unresponsive_s`) is marked failed (`Replica.failed`). The requests waiting
on it then give up (`ReplicaSet.request`) and go to recovery: a launched replica is killed and restarted from
the current weights, an attached one is dropped. A replica being restarted is not checked."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


def answers_health(session, url: str, timeout_s: float) -> bool:
    """Whether the server at `url` answers `/health` with 200 within `timeout_s`."""
    try:
        return session.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except OSError:  # requests' connection errors and timeouts are OSErrors
        return False


class ReplicaWatch:
    def __init__(self, replicas, session, unresponsive_s: float) -> None:
        self.replicas, self.session, self.unresponsive_s = replicas, session, unresponsive_s
        self.interval_s = min(5.0, unresponsive_s / 4)
        self.check_timeout_s = min(10.0, unresponsive_s / 2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        now = time.monotonic()
        for r in self.replicas:
            r.last_healthy = now
        self._thread = threading.Thread(target=self._run, name="replica-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.check_timeout_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for r in list(self.replicas):
                if r.restarting or r.dropped or r.failed.is_set():
                    continue
                if answers_health(self.session, r.url, self.check_timeout_s):
                    r.last_healthy = time.monotonic()
                elif (silent := time.monotonic() - r.last_healthy) > self.unresponsive_s and not r.restarting:
                    log.warning(
                        "rollout server %s has not answered a health check for %.0f s (rollout.servers.unresponsive_s "
                        "= %g); taking it for frozen", r.url, silent, self.unresponsive_s,
                    )  # fmt: skip
                    r.failed.set()
