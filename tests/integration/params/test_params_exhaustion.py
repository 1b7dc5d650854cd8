"""The parameter server survives resource exhaustion: its data plane accepts again once the
descriptors it ran out of come back (and health says when it cannot accept at all), a reader that
never reads loses its version pin on either port, and a tensor table too large for any host is
refused with a 4xx, never a 500."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from support import free_port, start_cli
from support.sockets import address, closed_by_peer, connect, read_all, wait_for
from test_params_server import config

from staleflow.api.base import ServiceError
from staleflow.servers.http import ConnectionLimits, serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.client import ParamsClient

DESCRIPTORS = 128  # the server's RLIMIT_NOFILE: far below the connections the test opens


def limit_descriptors() -> None:  # runs in the server's process, before it starts
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


def test_the_data_plane_accepts_again_after_running_out_of_descriptors(tmp_path: Path,
                                                                       sockets: list[socket.socket]) -> None:
    port = free_port()
    log: list[str] = []
    proc = start_cli("serve", "params", "--state-dir", str(tmp_path), "--port", str(port), "--no-fsync",
                     preexec_fn=limit_descriptors, log=log)
    try:
        with ParamsClient(f"http://127.0.0.1:{port}") as client:
            data_url = f"http://127.0.0.1:{client.health().data_port}"
            for _ in range(2 * DESCRIPTORS):  # each accepted one takes a descriptor of the server's
                connect(data_url, sockets)
            wait_for(lambda: len(os.listdir(f"/proc/{proc.pid}/fd")) >= DESCRIPTORS,
                     "the data plane to take every descriptor the server may open")
            for sock in sockets:  # the descriptors come back; the backlog drains
                sock.close()
            sockets.clear()
            answered = connect(data_url, sockets)
            answered.sendall(b"GET /v1/params/1/chunks/0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, _, body = read_all(answered).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404") and json.loads(body)["code"] == "unknown_version"
            health = client.health()
            assert health.data_plane_accept_failures >= 1 and health.status == "ok"
            assert any("cannot accept a connection: EMFILE" in line for line in log)
    finally:
        proc.terminate()
        proc.wait(30)


def test_health_answers_503_when_the_data_plane_stops_accepting(tmp_path: Path) -> None:
    app = create_app(config(tmp_path))
    with serve_in_thread(app) as server, ParamsClient(server.url) as client:
        assert client.health().status == "ok"
        app.state.data_plane._listener.shutdown(socket.SHUT_RDWR)  # accept fails for good: no shortage that passes
        wait_for(lambda: not app.state.data_plane.accepting, "the accept loop to stop")
        with pytest.raises(ServiceError) as refused:
            client.health()
        assert refused.value.status == 503 and refused.value.code == "transport_unavailable"


@pytest.fixture
def stingy(tmp_path: Path) -> Iterator[tuple[str, ParamsClient]]:
    """A PS keeping 2 versions that gives a reader 1 s to take some of a response, on both ports;
    one chunk per version, larger than loopback's socket buffers hold."""
    limits = ConnectionLimits(send_timeout_s=1.0, send_rate_grace_s=1.0)
    app = create_app(ParamsConfig(state_dir=tmp_path, port=0, fsync=False, keep=2, chunk_bytes=32 << 20), limits=limits)
    with serve_in_thread(app, limits=limits) as server, ParamsClient(server.url) as client:
        yield server.url, client


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(8 << 20, version, np.float32)}  # 32 MiB


@pytest.mark.parametrize("port", ["api", "data"])
def test_a_reader_that_never_reads_loses_its_version_pin(stingy: tuple[str, ParamsClient], port: str,
                                                         sockets: list[socket.socket]) -> None:
    url, client = stingy
    client.push(1, weights(1), transport="http")
    target = url if port == "api" else f"http://127.0.0.1:{client.health().data_port}"
    path = "/v1/params/1/file" if port == "api" else "/v1/params/1/chunks/0"
    idle = [connect(target, sockets) for _ in range(3)]
    for sock in idle:  # ... and never read a byte
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    wait_for(lambda: client.versions().readers["streams"] == 3, "the three responses to start")
    client.push(2, weights(2), transport="http")
    client.push(3, weights(3), transport="http")  # version 1 falls out of the newest 2, pinned by the readers
    wait_for(lambda: [v.version for v in client.versions().versions] == [2, 3],
             "the idle readers' pins to go and version 1 with them", timeout_s=30)
    assert client.versions().readers["streams"] == 0
    wait_for(lambda: all(closed_by_peer(sock) for sock in idle), "the server to close the idle readers", timeout_s=30)
    assert client.pull(3, "http")["w"][0] == 3  # a reader that reads is served as before


@pytest.mark.parametrize("port", ["api", "data"])
def test_a_reader_that_takes_a_response_too_slowly_loses_it(tmp_path: Path, port: str) -> None:
    limits = ConnectionLimits(send_timeout_s=30.0, min_send_rate=4 << 20, send_rate_grace_s=0.5)
    app = create_app(ParamsConfig(state_dir=tmp_path, port=0, fsync=False, chunk_bytes=32 << 20), limits=limits)
    with serve_in_thread(app, limits=limits) as server, ParamsClient(server.url) as client:
        client.push(1, weights(1), transport="http")
        target = server.url if port == "api" else f"http://127.0.0.1:{client.health().data_port}"
        path = "/v1/params/1/file" if port == "api" else "/v1/params/1/chunks/0"
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connecting: a small window
            slow.connect(address(target))
            slow.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            wait_for(lambda: client.versions().readers["streams"] == 1, "the response to start")
            give_up = time.monotonic() + 30
            while client.versions().readers["streams"]:  # 4 KiB every 0.1 s: about 40 KiB/s, far below 4 MiB/s
                assert time.monotonic() < give_up, "the server still sends to a reader below the minimum rate after 30 s"
                slow.recv(4 << 10)
                time.sleep(0.1)  # the client's pace, not a wait for the server


@pytest.mark.parametrize("shape", [[2**64], [2**32, 2**32, 2**32], [2**48, 2**3], [1] * 65])
def test_a_table_too_large_for_any_host_is_refused_with_422(tmp_path: Path, shape: list[int]) -> None:
    with serve_in_thread(create_app(config(tmp_path))) as server, httpx.Client(base_url=server.url) as http:
        tensors = {"tensors": [{"name": "w", "dtype": "F32", "shape": shape}]}
        for path in ("/v1/params/1", "/v1/params/1/parts/0"):
            body = tensors if path == "/v1/params/1" else {**tensors, "parts": 1, "via": "http"}
            answer = http.post(path, json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["code"] in ("invalid_format", "invalid_request")
        assert http.get("/v1/health").json()["status"] == "ok"  # the same keep-alive connection still serves
        assert http.get("/v1/params").json()["pushes"] == []
