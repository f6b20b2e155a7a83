"""Loopback networking helpers shared by the rollout servers and their weight transports."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now at `host` (the OS picks it; a race with another process is possible
    but rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
