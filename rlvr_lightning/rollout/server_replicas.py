"""The `vllm serve` replicas of one server engine: launched on this machine (`server_process.py`) or attached by
URL, checked healthy, and the requests every replica gets alike.

A request that fails, or waits on a replica its health checks found frozen (`replica_watch.py`), goes to
recovery: a replica that still answers its health check gets the request again (a dropped connection); a
launched one that died or froze is killed, restarted and given the current weights, then gets it again; an
attached one that stopped answering is dropped with a warning and its requests go to the others; the run stops
with one line when none remains. A re-sent request is the same request (its seed included), so it samples
what it would have."""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlvr_lightning.rollout.adapters import ADAPTER_PREFIX
from rlvr_lightning.rollout.replica_watch import ReplicaWatch, answers_health
from rlvr_lightning.rollout.server_client import RolloutServerRefused, ServerClient
from rlvr_lightning.rollout.server_process import (
    RolloutServerError,
    RolloutServerLost,
    ServerProcess,
    ServerSpec,
    placement,
)

log = logging.getLogger(__name__)


# How many times one request is sent again before the run stops: each time its replica was found dead,
# frozen or dropped, or its connection lost; more in a row means the replicas keep failing.
MAX_REISSUES = 3
RESTORE = Callable[["Replica"], None]  # gives a restarted replica the current weights and version


@dataclass
class Replica:
    url: str
    process: ServerProcess | None = None  # None: attached to a server someone else runs
    restarts: int = 0
    failed: threading.Event = field(default_factory=threading.Event)  # its health checks found it frozen
    dropped: bool = False  # attached, stopped answering: no request goes to it any more
    restarting: bool = False
    last_healthy: float = 0.0


class ReplicaSet:
    def __init__(
        self,
        client: ServerClient,
        spec: ServerSpec,
        replicas: int,
        urls: list[str] | None,
        node_slot: tuple[int, int],
        cuda_devices: list[str] | None,
        unresponsive_s: float | None = None,
    ) -> None:
        """`urls`: attach to these servers instead of launching `replicas` of them; `unresponsive_s`: how long a
        replica may leave its health checks unanswered before it is taken for frozen (None: not watched); the
        other arguments as `VLLMServerEngine`'s. Nothing starts before `start`."""
        self.client = client
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlvr-vllm-servers-"))
        self._restart_lock = threading.Lock()
        self.restarts_total = 0  # replicas restarted, over the run
        self.reissued_total = 0  # requests sent again after a failure, over the run
        self.watch = ReplicaWatch(self, client.session, unresponsive_s) if unresponsive_s else None
        self.closed = False
        # Gives a restarted replica the current weights and version; the engine sets its own (a teacher's replicas
        # never change weights).
        self.restore: RESTORE = lambda _replica: None
        self.replicas: list[Replica] = []
        if urls:
            self.replicas = [Replica(u.rstrip("/")) for u in urls]
        else:
            where = placement(replicas, *node_slot, cuda_devices)
            for i in range(replicas):
                proc = ServerProcess(spec, self.log_dir, i, *where[i])
                self.replicas.append(Replica("", proc))

    def __iter__(self) -> Iterator[Replica]:
        """The replicas that take requests (a dropped one no longer does)."""
        return iter([r for r in self.replicas if not r.dropped])

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __len__(self) -> int:
        return len(self.replicas)

    def start(self) -> None:
        """Launch every replica of ours, then wait until each is healthy; an attached one must answer now."""
        for r in self.replicas:
            if r.process is not None:
                r.process.start()
        for r in self.replicas:
            if r.process is not None:
                r.process.wait_healthy(self.client.session)
                r.url = r.process.url
            else:
                self._check_attached(r.url)
        if self.watch is not None:
            self.watch.start()

    def _check_attached(self, url: str) -> None:
        try:
            ok = self.client.session.get(f"{url}/health", timeout=10).status_code == 200
        except OSError as e:
            raise RolloutServerError(f"cannot reach the vLLM server at {url} (rollout.servers.urls): {e}") from e
        if not ok:
            raise RolloutServerError(f"the vLLM server at {url} (rollout.servers.urls) is not healthy")

    def post_each(self, route: str, **kwargs) -> None:
        """The same request to every replica that is not dropped, one after the other (each recovered as in
        `request`)."""
        for r in self:
            self.request(r, route, **kwargs)

    def live(self) -> list[int]:
        """The indexes of the replicas requests may go to (all but dropped ones)."""
        return [i for i, r in enumerate(self.replicas) if not r.dropped]

    def request(self, replica: int | Replica, route: str, timeout: float | None = None, **kwargs) -> tuple[dict, int]:
        """POST `route` to `replica` (an index or the replica), recovering from a replica that dies, freezes or
        drops the connection (see the module docstring); returns the answer and the index of the replica that
        gave it."""
        index = replica if isinstance(replica, int) else next(i for i, r in enumerate(self.replicas) if r is replica)
        for sent_again in range(MAX_REISSUES + 1):
            r = self.replicas[index]
            restarts_seen = r.restarts
            try:
                return self._post_watched(r, route, timeout, **kwargs), index
            except RolloutServerLost:
                raise
            except RolloutServerError as err:
                if sent_again == MAX_REISSUES:
                    raise RolloutServerLost(
                        f"rollout server {r.url}: {route} failed {MAX_REISSUES + 1} times in a row, each after "
                        f"recovery ({err}); see its log, or the URLs in rollout.servers.urls"
                    ) from err
                index = self.recover(index, restarts_seen, err)
                self.reissued_total += 1
        raise AssertionError("unreachable")

    def _post_watched(self, r: Replica, route: str, timeout: float | None, **kwargs) -> dict:
        """The POST, given up when the replica's health checks find it frozen, it is restarted meanwhile, or the
        engine closes. It runs on a daemon thread: one left waiting on a frozen server's socket (until the
        request's bound) never holds up the interpreter's exit, as a pool's worker would."""
        if r.failed.is_set():
            raise RolloutServerError(f"rollout server {r.url} is not answering its health checks")
        restarts_seen, outcome, done = r.restarts, {}, threading.Event()

        def call() -> None:
            try:
                outcome["answer"] = self.client.post(r.url, route, timeout, **kwargs)
            except BaseException as err:  # handed to the waiting thread
                outcome["error"] = err
            finally:
                done.set()

        threading.Thread(target=call, name="vllm-request", daemon=True).start()
        while not done.wait(0.5):
            if self.closed:
                raise RolloutServerLost(f"rollout server {r.url}: {route} abandoned, the engine is closing")
            if r.failed.is_set() or r.restarts != restarts_seen:
                raise RolloutServerError(
                    f"rollout server {r.url}: {route} abandoned, the server stopped answering its health checks "
                    "(rollout.servers.unresponsive_s)"
                )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def recover(self, index: int, restarts_seen: int, error: Exception) -> int:
        """After a failed request to replica `index`: the replica to send it to again. Requests in flight on a
        replica fail together; the first to get here restarts it, the others find it restarted."""
        r = self.replicas[index]
        with self._restart_lock:
            if self.closed:  # the run is ending: nothing to recover for
                raise RolloutServerLost(f"rollout server {r.url}: the engine closed while a request failed ({error})")
            if r.restarts != restarts_seen:
                return index  # another request restarted it meanwhile
            if not r.dropped and not r.failed.is_set() and self._answers(r):
                if isinstance(error, RolloutServerRefused):
                    raise error  # a healthy server refused the request itself: sending it again would not help
                log.info("rollout request to %s failed (%s); sending it again", r.url, error)
                return index
            if r.process is not None:
                self._restart(index, r, error)
                return index
            if not r.dropped:
                r.dropped = True
                log.warning("rollout server %s stopped answering (%s); dropping it", r.url, error)
            live = self.live()
            if not live:
                raise RolloutServerLost(
                    f"no rollout server remains: {', '.join(x.url for x in self.replicas)} stopped answering "
                    f"(last: {error}); check them, or the URLs in rollout.servers.urls"
                )
            return live[index % len(live)]

    def _answers(self, r: Replica) -> bool:
        """Alive (a launched one) and answering its health check, within a few seconds."""
        if r.process is not None and not r.process.alive():
            return False
        return answers_health(self.client.session, r.url, 5.0)

    def _restart(self, index: int, r: Replica, why: Exception | str) -> None:
        """Kill a launched replica (dead or frozen), start it again and `restore` the current weights on it (with
        plain requests: a failure there is an error, not another recovery under the restart lock)."""
        code = r.process.proc.returncode if r.process.proc is not None else None
        state = f"died (exit code {code})" if code is not None else "stopped answering"
        log.warning("vLLM server %d %s (%s); restarting it and sending its requests again", index, state, why)
        r.restarting = True
        try:
            r.process.stop(grace_s=0.0 if r.failed.is_set() else 10.0)  # a frozen one cannot handle SIGTERM
            r.process.start()
            r.process.wait_healthy(self.client.session)
            r.url = r.process.url
            self.restore(r)
            r.failed.clear()
            r.last_healthy = time.monotonic()
            r.restarts += 1
            self.restarts_total += 1
        finally:
            r.restarting = False

    def revive(self) -> None:
        """Before a sync: restart launched replicas found dead or frozen since the last request, drop attached ones
        that stopped answering, so the sync meets only replicas that answer."""
        for i, r in enumerate(self.replicas):
            dead = r.process is not None and not r.process.alive()
            if not r.dropped and (dead or r.failed.is_set()):
                self.recover(i, r.restarts, RolloutServerError(f"rollout server {r.url} found dead before a sync"))

    def unload_stale_adapters(self) -> None:
        """Attached servers outlive runs: a killed run (or one resumed at the version the last run reached)
        left its adapter loaded, and vLLM refuses to load a name it already holds. Adapters of other names
        (someone else's) stay."""
        for r in self.replicas:
            if r.process is None:
                try:
                    resp = self.client.session.get(f"{r.url}/v1/models", timeout=30)
                    resp.raise_for_status()
                    models = resp.json().get("data", [])
                except (OSError, ValueError) as e:  # requests' errors are OSErrors; a body not JSON a ValueError
                    raise RolloutServerError(f"rollout server {r.url}: /v1/models failed: {e}") from e
                for name in [m["id"] for m in models if m["id"].startswith(ADAPTER_PREFIX)]:
                    self.client.post(r.url, "/v1/unload_lora_adapter", json={"lora_name": name})

    def weight_versions(self) -> list[str]:
        session = self.client.session
        return [session.get(f"{r.url}/weight_info", timeout=30).json()["weight_version"] for r in self.replicas]

    def stop(self) -> None:
        """Stop the replicas this engine launched; attached ones keep running. Requests still waiting give up."""
        self.closed = True
        if self.watch is not None:
            self.watch.stop()
        for r in self.replicas:
            if r.process is not None:
                r.process.stop()
