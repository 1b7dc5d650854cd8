"""Servers shed slow and surplus clients: a deadline for request heads and for pauses in a body,
a cap on connections (the parameter server's data plane too) with a clear refusal, `Connection:
close` honoured; the bearer scheme is case-insensitive and duplicate Authorization headers are
refused (a job's owner-only state files: test_security)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import Request
from support.sockets import closed_by_peer, connect, read_all, wait_for

from staleflow.servers.http import (
    EPHEMERAL_PORTS,
    LOWEST_PLANNED_PORT,
    ConnectionLimits,
    RunningServer,
    bind_socket,
    free_port,
    serve_in_thread,
    service_app,
)
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params.dataplane import ChunkDataPlane
from staleflow.servers.params.store import ParamStore

SHORT = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5)


def echo_app():  # a service with the shared contract and nothing else
    app = service_app("limits test")

    @app.get("/v1/ping")
    def ping() -> dict:
        return {"ok": True}

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


def serve(limits: ConnectionLimits, token: str | None = None) -> RunningServer:
    return serve_in_thread(echo_app(), limits=limits, token=token)


def test_slow_header_connections_are_shed_and_others_are_served(sockets: list[socket.socket]) -> None:
    with serve(SHORT) as server:
        slow = [connect(server.url, sockets) for _ in range(200)]
        for sock in slow:
            sock.sendall(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the rest
        assert httpx.get(f"{server.url}/v1/ping").json() == {"ok": True}
        wait_for(lambda: all(closed_by_peer(sock) for sock in slow), "the server to close 200 slow-header connections")
        idle = connect(server.url, sockets)  # one that sends nothing at all
        wait_for(lambda: closed_by_peer(idle), "the server to close an idle connection")
        assert httpx.get(f"{server.url}/v1/ping").json() == {"ok": True}


def test_a_body_that_stalls_is_shed_and_a_whole_one_is_not(sockets: list[socket.socket]) -> None:
    with serve(SHORT) as server:
        stalled = connect(server.url, sockets)
        stalled.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        wait_for(lambda: closed_by_peer(stalled), "the server to close a stalled body")
        assert httpx.post(f"{server.url}/v1/echo", content=b"x" * 100).json() == {"bytes": 100}


def trickle(sock: socket.socket, data: bytes, every_s: float, timeout_s: float = 20.0) -> bool:
    """Send ``data`` a byte at a time, one every ``every_s`` (a client's pace, not a wait for the
    server); True once the server has closed the connection, False if all of it went through."""
    give_up = time.monotonic() + timeout_s
    for byte in data:
        assert time.monotonic() < give_up, f"the server still held a trickling connection after {timeout_s:g} s"
        if closed_by_peer(sock):
            return True
        try:
            sock.setblocking(True)
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
        time.sleep(every_s)
    return False


def test_a_body_trickled_below_the_minimum_rate_is_shed(sockets: list[socket.socket]) -> None:
    # a byte every 0.1 s (10 bytes/s, at most) never pauses for the 3 s the pause deadline allows:
    # only the rate catches it. The steady body, 100 bytes every 0.1 s, is 20 times the floor: a test
    # thread left unscheduled for a few seconds on a loaded machine still keeps it above
    limits = ConnectionLimits(body_timeout_s=3.0, min_body_rate=50, body_rate_grace_s=0.5)
    with serve(limits) as server:
        slow = connect(server.url, sockets)
        slow.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        assert trickle(slow, b"x" * 1000, every_s=0.1), "the trickled body was served"
        steady = connect(server.url, sockets)  # above the floor, though in pieces with pauses: served
        steady.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n")
        for _ in range(10):
            steady.sendall(b"x" * 100)
            time.sleep(0.1)
        head, _, body = read_all(steady).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"bytes": 1000}


def test_an_oversized_request_head_closes_the_connection(sockets: list[socket.socket]) -> None:
    with serve(ConnectionLimits(max_head_bytes=4096)) as server:
        sock = connect(server.url, sockets)
        sock.sendall(b"GET /v1/ping HTTP/1.1\r\n" + b"X-Long: " + b"a" * 8192)
        wait_for(lambda: closed_by_peer(sock), "the server to close a connection with a huge head")


def test_the_connection_cap_refuses_clearly_and_frees_up(sockets: list[socket.socket]) -> None:
    with serve(ConnectionLimits(max_connections=4, header_timeout_s=60)) as server:
        held = [connect(server.url, sockets) for _ in range(4)]
        wait_for(lambda: len(server.server.server_state.connections) == 4, "the server to accept 4 connections")
        refused = connect(server.url, sockets)
        head, _, body = read_all(refused).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
        error = json.loads(body)
        assert error["code"] == "too_many_connections" and "limit of 4" in error["detail"]
        held.pop().close()
        wait_for(lambda: len(server.server.server_state.connections) < 4, "a held connection to be released")
        assert httpx.get(f"{server.url}/v1/ping").json() == {"ok": True}


def test_the_bearer_scheme_is_case_insensitive_and_one_header_is_allowed() -> None:
    with serve(ConnectionLimits(), token="s3cret") as server:
        url = f"{server.url}/v1/echo"
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert httpx.post(url, content=b"ab", headers={"Authorization": f"{scheme} s3cret"}).status_code == 200
        twice = httpx.post(url, content=b"ab", headers=[("Authorization", "Bearer s3cret"), ("Authorization", "Bearer s3cret")])
        assert twice.status_code == 401 and twice.json()["code"] == "unauthorized"
        assert "2 Authorization headers" in twice.json()["detail"]
        for wrong in ("Basic s3cret", "Bearer", "Bearer nope", "s3cret"):
            assert httpx.post(url, content=b"ab", headers={"Authorization": wrong}).status_code == 401


@pytest.fixture
def data_plane(tmp_path: Path) -> Iterator[ChunkDataPlane]:
    store = ParamStore(ParamsConfig(state_dir=tmp_path, port=0, fsync=False))
    plane = ChunkDataPlane(store, "127.0.0.1", 0, "s3cret", ConnectionLimits(max_connections=2))
    yield plane
    plane.close()
    store.close()


def test_the_data_plane_caps_connections_and_honours_connection_close(data_plane: ChunkDataPlane,
                                                                      sockets: list[socket.socket]) -> None:
    url = f"http://127.0.0.1:{data_plane.port}"
    held = [connect(url, sockets) for _ in range(2)]
    wait_for(lambda: len(data_plane._connections) == 2, "the data plane to serve 2 connections")
    head, _, body = read_all(connect(url, sockets)).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
    assert json.loads(body)["code"] == "too_many_connections"
    for sock in held:
        sock.close()
    wait_for(lambda: not data_plane._connections, "the data plane to release its connections")

    closing = connect(url, sockets)
    closing.sendall(b"GET /v1/params/1/chunks/0?lease=none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = read_all(closing).partition(b"\r\n\r\n")  # returns only once the server closes
    assert head.startswith(b"HTTP/1.1 4") and json.loads(body)["code"]

    push = connect(url, sockets)  # the data plane's own token check: the scheme is case-insensitive too
    push.sendall(b"PUT /v1/params/1/chunks/0 HTTP/1.1\r\nHost: x\r\nauthorization: bearer s3cret\r\nContent-Length: 0\r\n"
                 b"Connection: close\r\n\r\n")
    answer = json.loads(read_all(push).partition(b"\r\n\r\n")[2])
    assert answer["code"] != "unauthorized" and "push_id" in answer["detail"]



def test_the_data_plane_sheds_connections_without_a_timely_request_head(tmp_path: Path,
                                                                        sockets: list[socket.socket]) -> None:
    store = ParamStore(ParamsConfig(state_dir=tmp_path, port=0, fsync=False))
    plane = ChunkDataPlane(store, "127.0.0.1", 0, "s3cret", ConnectionLimits(header_timeout_s=0.5))
    try:
        url = f"http://127.0.0.1:{plane.port}"
        trickling = connect(url, sockets)  # a head that never ends, a byte at a time
        assert trickle(trickling, b"GET /v1/params/1/chunks/0?lease=none HTTP/1.1\r\nX-Slow: " + b"a" * 1000,
                       every_s=0.05), "the data plane served a head trickled for a minute"
        idle = connect(url, sockets)  # one that sends nothing at all
        wait_for(lambda: closed_by_peer(idle), "the data plane to close an idle connection", timeout_s=20)
        wait_for(lambda: not plane._connections, "the data plane to release its connections", timeout_s=20)
        answered = connect(url, sockets)
        answered.sendall(b"GET /v1/params/1/chunks/0?lease=none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, _, body = read_all(answered).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 4") and json.loads(body)["code"]
    finally:
        plane.close()
        store.close()


def test_a_planned_port_is_free_and_outside_the_ports_outgoing_connections_take() -> None:
    """A planned endpoint's port stays free until its server binds it: drawn below the kernel's
    ephemeral range, from which every outgoing connection takes its local port."""
    ports = [free_port("127.0.0.1") for _ in range(50)]
    low = int(Path(EPHEMERAL_PORTS).read_text().split()[0])  # this suite runs on Linux
    assert all(LOWEST_PLANNED_PORT <= port < low for port in ports), (ports, low)
    assert len(set(ports)) > 40, "drawn at random, not handed out in turn"
    bind_socket("127.0.0.1", ports[0]).close()  # what the planned server does
