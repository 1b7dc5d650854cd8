"""Running FastAPI apps under uvicorn: in a background thread (embedded mode, tests) or in the
foreground (``staleflow serve``). The listening socket is bound before uvicorn starts, so the URL
is valid immediately: connections queue in the backlog until the server accepts them."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

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


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> RunningServer:
    """Serve ``app`` from a daemon thread; returns once the socket is listening."""
    sock = bind_socket(host, port)
    server = uvicorn.Server(_uvicorn_config(app, log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{url_for(sock)}")
    thread.start()
    return RunningServer(url_for(sock), server, thread)


def serve_forever(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve in the foreground until SIGINT/SIGTERM (uvicorn handles both gracefully)."""
    sock = bind_socket(host, port)
    log.info("listening on %s", url_for(sock))
    uvicorn.Server(_uvicorn_config(app, log_level)).run(sockets=[sock])
