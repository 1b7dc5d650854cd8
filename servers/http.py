"""Running FastAPI apps under uvicorn: in a background thread (embedded mode, tests) or in the
foreground (``staleflow serve``). The listening socket is bound before uvicorn starts, so the URL
is valid immediately: connections queue in the backlog until the server accepts them."""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from staleflow.servers.auth import protect

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it keep-alive responses stall ~40 ms on Nagle + delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {exc.strerror or exc}. Pick another --port or stop the other process.") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_for(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _uvicorn_config(app: FastAPI, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=5)


@dataclass
class RunningServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StartupFailed(RuntimeError):
    """The app's lifespan raised: the server never served."""


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    startup_timeout: float = 60.0, token: str | None = None) -> RunningServer:
    """Serve ``app`` from a daemon thread; returns once its lifespan has started.

    A lifespan that fails raises ``StartupFailed`` here instead of leaving a socket that never
    answers."""
    protect(app, host, token, is_loopback(host))
    sock = bind_socket(host, port)
    server = uvicorn.Server(_uvicorn_config(app, log_level))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # uvicorn exits with SystemExit on a failed startup
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True, name=f"uvicorn-{url_for(sock)}")
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        thread.join(0.005)  # wakes as soon as the thread dies; otherwise re-checks the flag
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            reason = failure[0] if failure else "timed out"
            raise StartupFailed(f"{app.title} did not start: {reason!r}; see the log above for the cause")
    return RunningServer(url_for(sock), server, thread)


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info", token: str | None = None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM (uvicorn handles both gracefully).

    With a token (or $STALEFLOW_TOKEN), mutating requests need it; without one, a non-loopback
    ``host`` is refused."""
    protect(app, host, token, is_loopback(host))
    sock = bind_socket(host, port)
    # printed at every log level: supervisors (staleflow up, tests) wait for this line
    print(f"{app.title} listening on {url_for(sock)}", file=sys.stderr, flush=True)
    uvicorn.Server(_uvicorn_config(app, log_level)).run(sockets=[sock])
