"""Fixtures of the fault tests: stand-in replicas on loopback for the recovery logic (the real `vllm serve`
replicas are killed and frozen in tests/rollout/test_vllm_server.py and in the `make faults` runs)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeReplica:
    """An HTTP server that answers `/health` and POSTs as its `mode` says: `ok` (200 and {"route": …}),
    `drop-once` (the first POST's connection closed unanswered, then ok), `refuse` (POSTs answered 500) or
    `frozen` (nothing answered until `thaw`)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.posts, self.thawed = mode, [], threading.Event()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def _frozen(self) -> bool:
                if replica.mode == "frozen":
                    replica.thawed.wait()
                    return True
                return False

            def do_GET(self):
                if self._frozen():
                    return
                self._answer(200, {"ok": True})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                replica.posts.append(self.path)
                if self._frozen():
                    return
                if replica.mode == "drop-once":
                    replica.mode = "ok"
                    self.close_connection = True
                    self.connection.close()
                    return
                if replica.mode == "refuse":
                    self._answer(500, {"error": "bad request"})
                    return
                self._answer(200, {"route": self.path})

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def thaw(self) -> None:
        self.mode = "ok"
        self.thawed.set()

    def close(self) -> None:
        self.thaw()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_replicas():
    made: list[FakeReplica] = []

    def make(*modes: str) -> list[FakeReplica]:
        made.extend(FakeReplica(m) for m in modes)
        return made[-len(modes) :]

    yield make
    for r in made:
        r.close()
