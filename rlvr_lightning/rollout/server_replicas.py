"""The `vllm serve` replicas of one server engine: launched on this machine (`server_process.py`) or attached by
URL, checked healthy, a dead launched one restarted, and the requests every replica gets alike."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlvr_lightning.rollout.adapters import ADAPTER_PREFIX
from rlvr_lightning.rollout.server_client import ServerClient
from rlvr_lightning.rollout.server_process import RolloutServerError, ServerProcess, ServerSpec, placement

log = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    process: ServerProcess | None = None  # None: attached to a server someone else runs
    restarts: int = 0


class ReplicaSet:
    def __init__(
        self,
        client: ServerClient,
        spec: ServerSpec,
        replicas: int,
        urls: list[str] | None,
        node_slot: tuple[int, int],
        cuda_devices: list[str] | None,
    ) -> None:
        """`urls`: attach to these servers instead of launching `replicas` of them; the other arguments as
        `VLLMServerEngine`'s. Nothing starts before `start`."""
        self.client = client
        self.log_dir = Path(tempfile.mkdtemp(prefix="rlvr-vllm-servers-"))
        self._restart_lock = threading.Lock()
        self.replicas: list[Replica] = []
        if urls:
            self.replicas = [Replica(u.rstrip("/")) for u in urls]
        else:
            where = placement(replicas, *node_slot, cuda_devices)
            for i in range(replicas):
                proc = ServerProcess(spec, self.log_dir, i, *where[i])
                self.replicas.append(Replica("", proc))

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

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

    def _check_attached(self, url: str) -> None:
        try:
            ok = self.client.session.get(f"{url}/health", timeout=10).status_code == 200
        except OSError as e:
            raise RolloutServerError(f"cannot reach the vLLM server at {url} (rollout.server_urls): {e}") from e
        if not ok:
            raise RolloutServerError(f"the vLLM server at {url} (rollout.server_urls) is not healthy")

    def post_each(self, route: str, **kwargs) -> None:
        """The same request to every replica, one after the other."""
        for r in self.replicas:
            self.client.post(r.url, route, **kwargs)

    def recover(self, index: int, restarts_seen: int, error: Exception, restore: Callable[[Replica], None]) -> None:
        """A failed request: restart a launched replica that died and `restore` the current weights on it,
        else raise. Requests in flight on it fail together; the first to get here restarts it, the others
        retry."""
        r = self.replicas[index]
        with self._restart_lock:
            if r.restarts != restarts_seen:
                return  # another request restarted it meanwhile
            if r.process is None or r.process.alive():
                # Still running (or not ours to restart): a dropped connection; the caller's one retry
                # on a fresh connection decides, and raises if the server really refuses.
                log.info("rollout request to %s failed (%s); retrying once", r.url, error)
                return
            code = r.process.proc.returncode if r.process.proc is not None else None
            log.warning("vLLM server %d died (exit code %s); restarting it and retrying its prompts", index, code)
            r.process.stop()
            r.process.start()
            r.process.wait_healthy(self.client.session)
            r.url = r.process.url
            restore(r)
            r.restarts += 1

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
        """Stop the replicas this engine launched; attached ones keep running."""
        for r in self.replicas:
            if r.process is not None:
                r.process.stop()
