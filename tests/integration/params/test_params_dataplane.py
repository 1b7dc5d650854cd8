"""The parameter server's data plane: chunk bodies on their own port (a thread per connection),
with the API's paths, rules, token and error bodies; clients find it in /v1/health and fall back
to the API port when it cannot be reached."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_params_server import CHUNK, assert_same, config, start_raw_push, state_dict

from staleflow.servers.http import RunningServer, serve_in_thread
from staleflow.servers.params import create_app
from staleflow.transports.checksums import checksum_of
from staleflow.transports.client import ParamsClient
from staleflow.transports.http import CHECKSUM_HEADER, HttpTransport, RawHttpConnection
from staleflow.transports.layout import plan_chunks
from staleflow.transports.regions import ByteRegions


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    with serve_in_thread(create_app(config(tmp_path, keep=2))) as running:
        yield running


def data_url(client: ParamsClient) -> str:
    port = client.health().data_port
    assert port and port != int(client.url.rsplit(":", 1)[1])
    return f"http://127.0.0.1:{port}"


def error_of(body: bytes) -> tuple[str, str]:
    answer = json.loads(body)
    return answer["code"], answer["detail"]


def test_chunks_pushed_and_pulled_through_the_data_plane_round_trip(server: RunningServer) -> None:
    with ParamsClient(server.url) as client:
        pushed = state_dict(1, scale=3)
        begin, session = start_raw_push(client, 1, pushed)
        source = session[0]
        with RawHttpConnection(data_url(client)) as conn:  # one keep-alive connection for every chunk
            for chunk in plan_chunks(begin["total_bytes"], begin["chunk_bytes"]):
                views = source.views(chunk.offset, chunk.length)
                status, _, body = conn.request("PUT", f"/v1/params/1/chunks/{chunk.index}?push_id={begin['push_id']}",
                                               {CHECKSUM_HEADER: checksum_of("xxh3_64", views)}, views)
                assert status == 200 and json.loads(body)["checksum"] == checksum_of("xxh3_64", views)
        client.http.post("/v1/params/1/commit", params={"push_id": begin["push_id"]}).raise_for_status()

        lease = client.open_pull(1, "http")
        with RawHttpConnection(data_url(client)) as conn:
            for chunk in lease.manifest.chunks:
                status, headers, body = conn.request("GET", f"/v1/params/1/chunks/{chunk.index}?lease={lease.lease_id}")
                assert status == 200 and headers[CHECKSUM_HEADER] == chunk.checksum
                assert checksum_of(chunk.checksum.split(":")[0], [memoryview(body)]) == chunk.checksum
        client.close_pull(lease)
        assert_same(client.pull(1, "http"), pushed)  # the client's own http transport


def test_sharded_http_pushes_use_the_data_plane_at_once(server: RunningServer) -> None:
    """Three parts pushed at once from three threads, each on its own connection."""
    from staleflow.transports.client import ShardPiece

    full = np.arange(3 * 4 * CHUNK // 4, dtype=np.uint32).reshape(12, -1)
    table = {"w": ("U32", tuple(full.shape))}
    replies: list[dict] = []

    def push(part: int) -> None:
        rows = full[part * 4:(part + 1) * 4]
        with ParamsClient(server.url) as client:
            replies.append(client.push_part(7, part, 3, table, [ShardPiece("w", rows.nbytes * part, rows)],
                                            transport="http", wait_s=30))

    threads = [threading.Thread(target=push, args=(part,)) for part in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(r["visible"] for r in replies) == [True, True, True]
    with ParamsClient(server.url) as client:
        assert client.pull(7, "http")["w"].tobytes() == full.tobytes()


def test_refusals_carry_the_one_error_body(server: RunningServer) -> None:
    with ParamsClient(server.url) as client:
        url = data_url(client)
        begin, session = start_raw_push(client, 2, state_dict(2))
        views = session[0].views(0, begin["chunks"][0]["length"])
        target = f"/v1/params/2/chunks/0?push_id={begin['push_id']}"
        with RawHttpConnection(url) as conn:
            status, _, body = conn.request("GET", "/v1/params")
            assert status == 404 and error_of(body)[0] == "not_found" and "API port" in error_of(body)[1]
            status, _, body = conn.request("DELETE", target)
            assert status == 405 and error_of(body)[0] == "method_not_allowed"
            # a bad checksum is refused after the body was read: the connection carries the next request
            status, _, body = conn.request("PUT", target, {CHECKSUM_HEADER: "xxh3_64:0000000000000000"}, views)
            assert status == 422 and error_of(body)[0] == "checksum_mismatch"
            status, _, body = conn.request("PUT", target, {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
            assert status == 200
        for path, code in (("/v1/params/2/chunks/0?push_id=nope", "push_id_mismatch"),
                           ("/v1/params/2/chunks/0", "invalid_request"),
                           (f"/v1/params/9/chunks/0?push_id={begin['push_id']}", "unknown_push")):
            with RawHttpConnection(url) as conn:  # refused before the body: the server closes the connection
                status, headers, body = conn.request("PUT", path, {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
                assert error_of(body)[0] == code and headers.get("connection") == "close", path
        with RawHttpConnection(url) as conn:
            status, _, body = conn.request("GET", "/v1/params/1/chunks/0")
            assert status == 404 and error_of(body)[0] == "unknown_version"


def test_a_client_that_vanishes_mid_chunk_leaves_the_chunk_unreceived(server: RunningServer) -> None:
    with ParamsClient(server.url) as client:
        pushed = state_dict(3, scale=2)
        begin, session = start_raw_push(client, 3, pushed)
        views = session[0].views(0, begin["chunks"][0]["length"])
        conn = RawHttpConnection(data_url(client))
        conn.send("PUT", f"/v1/params/3/chunks/0?push_id={begin['push_id']}", {CHECKSUM_HEADER: checksum_of("crc32", views)})
        conn._connection().sock.sendall(views[0][:1000])
        conn.close()
        refused = client.http.post("/v1/params/3/commit", params={"push_id": begin["push_id"]})
        assert refused.status_code == 409 and refused.json()["code"] == "version_incomplete"
        progress = client.versions().pushes
        while progress[0].writing:  # the server's thread notices the disconnect on its own
            progress = client.versions().pushes
        assert progress[0].received_chunks == 0
        with RawHttpConnection(data_url(client)) as again:  # the chunk can be sent again
            for chunk in plan_chunks(begin["total_bytes"], begin["chunk_bytes"]):
                views = session[0].views(chunk.offset, chunk.length)
                status, _, _ = again.request("PUT", f"/v1/params/3/chunks/{chunk.index}?push_id={begin['push_id']}",
                                             {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
                assert status == 200
        client.http.post("/v1/params/3/commit", params={"push_id": begin["push_id"]}).raise_for_status()
        assert_same(client.pull(3, "http"), pushed)


def test_the_token_guards_chunk_uploads_not_downloads(tmp_path: Path) -> None:
    with serve_in_thread(create_app(config(tmp_path)), token="s3cret") as running, \
            ParamsClient(running.url, token="s3cret") as trainer:
        pushed = state_dict(1)
        trainer.push(1, pushed, transport="http")  # through the data plane, with the token
        assert_same(trainer.pull(1, "http"), pushed)
        begin, session = start_raw_push(trainer, 2, state_dict(2))
        views = session[0].views(0, begin["chunks"][0]["length"])
        lease = trainer.open_pull(1, "http")
        with RawHttpConnection(data_url(trainer)) as anonymous:
            status, _, body = anonymous.request("PUT", f"/v1/params/2/chunks/0?push_id={begin['push_id']}",
                                                {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
            assert status == 401 and error_of(body)[0] == "unauthorized"
        with RawHttpConnection(data_url(trainer)) as anonymous:  # reads stay open, as on the API port
            status, _, _ = anonymous.request("GET", f"/v1/params/1/chunks/0?lease={lease.lease_id}")
            assert status == 200


def test_an_unreachable_data_plane_falls_back_to_the_api_port(server: RunningServer) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
    asked: list[bool] = []

    def locate(refresh: bool) -> str:
        asked.append(refresh)
        return dead

    with ParamsClient(server.url) as client:
        client.push(4, state_dict(4), transport="http")
        lease = client.open_pull(4, "http")
        landed = np.zeros(lease.manifest.total_bytes, np.uint8)
        list(HttpTransport(server.url, data_plane=locate).pull(lease, ByteRegions.flat(landed)))
        client.close_pull(lease)
        assert asked == [False, True]  # asked the PS again once (it may have moved), then used the API port
        whole = client.pull(4, "http")
        for spec in lease.manifest.tensors:
            assert landed[spec.offset:spec.offset + spec.nbytes].tobytes() == np.asarray(whole[spec.name]).tobytes()


def test_a_server_without_a_data_plane_serves_chunks_on_the_api_port(tmp_path: Path) -> None:
    with serve_in_thread(create_app(config(tmp_path, data_port=None))) as running, ParamsClient(running.url) as client:
        assert client.health().data_port is None
        pushed = state_dict(5)
        client.push(5, pushed, transport="http")
        assert_same(client.pull(5, "http"), pushed)


def test_stopping_the_server_closes_the_data_plane(tmp_path: Path) -> None:
    running = serve_in_thread(create_app(config(tmp_path)))
    with ParamsClient(running.url) as client:
        port = client.health().data_port
        client.push(6, state_dict(6), transport="http")  # leaves a keep-alive connection open
    idle = RawHttpConnection(f"http://127.0.0.1:{port}")
    idle.connect()
    running.stop()
    assert not any(t.name.startswith("params-data") for t in threading.enumerate())
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    idle.close()


def test_a_connection_the_server_closes_is_reopened_for_the_next_request() -> None:
    """A response with ``Connection: close`` (a 413, a refused unread body) ends the connection:
    the client opens a new one for its next request instead of writing into the closed socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            accepted.append(1)
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with listener, RawHttpConnection(url, timeout=10) as conn:
        for _ in range(2):
            status, _, body = conn.request("GET", "/anything")
            assert (status, body) == (413, b"no")
    thread.join(10)
    assert len(accepted) == 2
