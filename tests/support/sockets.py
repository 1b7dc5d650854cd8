"""Raw sockets against a server on loopback: connect, read what it sends, see whether it closed,
and wait for a condition with a deadline (the tests of connection limits and slow clients)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s:g} s"
        time.sleep(0.02)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (what it answered first is read and dropped)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def read_all(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    sock.settimeout(timeout_s)
    chunks = []
    while data := sock.recv(1 << 16):
        chunks.append(data)
    return b"".join(chunks)


def connect(url: str, opened: list[socket.socket]) -> socket.socket:
    """A connection to ``url``, added to ``opened`` (the ``sockets`` fixture closes them)."""
    sock = socket.create_connection(address(url))
    opened.append(sock)
    return sock
