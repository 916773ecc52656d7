"""A TCP port free right now, for every tier (issue 41 item 6: one definition instead of a copy per module)."""

from __future__ import annotations

import socket


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port free on `ip` right now: the kernel picks it, and it is closed again before this returns,
    so nothing listens there until the caller binds it (or a test dials it to meet a closed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]
