"""Loopback networking helpers shared by the rollout servers and their weight transports."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; a race with another process is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
