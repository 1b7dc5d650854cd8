"""The parameter server: push/pull per transport, no torn versions under concurrency, retention
with leases, refusals, and a SIGKILL in the middle of a push."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from support import free_port

from staleflow.api.base import ServiceError
from staleflow.api.params import VersionDeleted
from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, ParamsError, ParamStore, create_app
from staleflow.servers.params.rules import parse_version_spec, shm_prefix, versions_to_drop
from staleflow.transports.checksums import checksum_of
from staleflow.transports.client import ParamsClient, RawTensor
from staleflow.transports.errors import FormatError
from staleflow.transports.http import CHECKSUM_HEADER, RawHttpConnection
from staleflow.transports.layout import plan_chunks
from staleflow.transports.nixl import nixl_available
from staleflow.transports.regions import ByteRegions

CHUNK = 64 << 10


def state_dict(version: int, scale: int = 1) -> dict[str, object]:
    """A few MB of mixed dtypes whose every byte depends on ``version``."""
    rng = np.random.default_rng(version)
    return {
        "embed.weight": rng.standard_normal((512 * scale, 384)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(333).astype(np.float16),
        "layers.0.step": np.array([version], dtype=np.int64),
        "layers.0.mask": rng.integers(0, 2, 77).astype(np.bool_),
        "empty": np.zeros((0, 5), np.float32),
        "scalar": np.array(version * 0.5),
        "bf16": RawTensor("BF16", (9, 7), rng.integers(0, 2**16, 63, dtype=np.uint16).tobytes()),
    }


def assert_same(pulled: dict[str, object], pushed: dict[str, object]) -> None:
    assert set(pulled) == set(pushed)
    for name, value in pushed.items():
        got = pulled[name]
        if isinstance(value, RawTensor):
            assert got.shape == value.shape and got.tobytes() == value.data, name
        else:
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert got.tobytes() == value.tobytes(), name


def config(tmp_path: Path, **overrides: object) -> ParamsConfig:
    return ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=CHUNK, fsync=False, **overrides)


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[ParamsClient]:
    with serve_in_thread(create_app(config(tmp_path, keep=2))) as server, ParamsClient(server.url) as client:
        client.health()
        yield client


TRANSPORTS = ["http", "shm", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available()[0], reason=nixl_available()[1]))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_pull_round_trip_is_byte_exact(tmp_path: Path, transport: str) -> None:
    transports = ("http", transport) if transport != "http" else ("http",)
    with serve_in_thread(create_app(config(tmp_path, transports=transports))) as server, ParamsClient(server.url) as client:
        pushed = state_dict(1)
        summary = client.push(1, pushed, metadata={"step": "1"})
        assert summary["version"] == 1 and summary["chunks"] > 10  # really chunked
        assert_same(client.pull(1, transport), pushed)
        # into the caller's buffers, and tensor by tensor as chunks land
        out = {k: np.empty_like(v) for k, v in client.pull(1, transport).items()}
        landed = client.pull("latest", transport, out=out)
        assert all(landed[k] is out[k] for k in out)
        assert_same(out, pushed)
        names = [name for name, _ in client.iter_pull(1, transport)]
        assert names == list(pushed)  # in data-section order, each as soon as its chunks verified
        assert client.manifest(1).metadata["step"] == "1"
        assert_same(client.pull(1, "auto"), pushed)  # shm where offered on this host, else http
        client.push(2, state_dict(2))  # a second version: new registrations, a reused shm slot
        assert_same(client.pull(2, transport), state_dict(2))
        assert_same(client.pull(1, transport), pushed)


def test_stored_version_is_a_safetensors_file(ps: ParamsClient, tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    pushed = {k: v for k, v in state_dict(3).items() if not isinstance(v, RawTensor)}
    ps.push(3, pushed)
    loaded = safetensors_numpy.load(ps.http.get("/v1/params/3/file").content)
    assert all(loaded[k].tobytes() == v.tobytes() and loaded[k].shape == v.shape for k, v in pushed.items())


def test_pulls_never_see_a_torn_version(tmp_path: Path) -> None:
    """One trainer pushes while four instances pull 'latest' over http and shm: every pull is
    one whole version (checksums verified, and each tensor matches the version it claims)."""
    with serve_in_thread(create_app(config(tmp_path, keep=2))) as server:
        with ParamsClient(server.url) as trainer:
            trainer.push(0, state_dict(0))
        versions = 8
        pushed_all = threading.Event()
        failures: list[BaseException] = []
        pulls: list[int] = []

        def instance(transport: str) -> None:
            try:
                with ParamsClient(server.url) as client:
                    while not pushed_all.is_set() or len(pulls) < 8:
                        lease = client.open_pull("latest", transport)
                        try:
                            got = dict(client.receive(lease))
                        finally:
                            client.close_pull(lease)
                        version = int(got["layers.0.step"][0])
                        assert version == lease.manifest.version
                        assert_same(got, state_dict(version))
                        pulls.append(version)
            except BaseException as exc:
                failures.append(exc)

        def trainer_loop() -> None:
            try:
                with ParamsClient(server.url) as trainer:
                    for v in range(1, versions):
                        trainer.push(v, state_dict(v))
            except BaseException as exc:
                failures.append(exc)
            finally:
                pushed_all.set()

        threads = [threading.Thread(target=instance, args=(t,)) for t in ("http", "shm", "http", "shm")]
        threads.append(threading.Thread(target=trainer_loop))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures
        assert len(set(pulls)) >= 2  # the pulls really overlapped several pushes
        with ParamsClient(server.url) as client:
            listing = client.versions()
            assert [v.version for v in listing.versions] == [versions - 2, versions - 1]
            assert listing.readers["leases"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_retention_keeps_newest_k_and_spares_versions_being_pulled(tmp_path: Path, transport: str) -> None:
    transports = ("http", "shm", "nixl") if transport == "nixl" else ("http", "shm")
    with serve_in_thread(create_app(config(tmp_path, keep=2, transports=transports))) as server, \
            ParamsClient(server.url) as ps:
        check_retention(ps, tmp_path, transport)


def check_retention(ps: ParamsClient, tmp_path: Path, transport: str) -> None:
    for v in (1, 2, 3):
        ps.push(v, state_dict(v))
    assert [v.version for v in ps.versions().versions] == [2, 3]
    with pytest.raises(ServiceError) as gone:
        ps.pull(1)
    assert gone.value.status == 404 and "not kept" in gone.value.detail

    lease = ps.open_pull(2, transport)  # an instance was told to fetch 2 ...
    ps.push(4, state_dict(4))  # ... while newer ones land
    ps.push(5, state_dict(5))
    listing = {v.version: v for v in ps.versions().versions}
    assert listing[2].retained is False and listing[2].leases == 1
    with pytest.raises(ServiceError) as refused:
        ps.open_pull(2)
    assert refused.value.status == 404
    assert_same(dict(ps.receive(lease)), state_dict(2))  # still served whole
    ps.close_pull(lease)
    assert [v.version for v in ps.versions().versions] == [4, 5]
    assert ps.wait_persisted(5, 60)
    # evicted versions leave the disk (renamed away at once, deleted in the background); 4 may be
    # skipped by the persister once 5 supersedes it
    on_disk = {p.name for p in (tmp_path / "versions").iterdir() if not p.name.startswith(".")}
    assert "v0000000005" in on_disk and on_disk <= {"v0000000004", "v0000000005"}
    assert ps.versions().shm["slots"] <= 3  # keep + 1 spare
    assert_same(ps.pull("latest-1"), state_dict(4))


def test_pull_of_a_version_being_pushed_waits_for_the_commit(ps: ParamsClient) -> None:
    ps.push(1, state_dict(1))
    pushed = state_dict(2)
    begin, session = start_raw_push(ps, 2, pushed)
    with pytest.raises(ServiceError) as busy:
        ps.open_pull(2)
    assert busy.value.status == 409 and "being pushed" in busy.value.detail
    assert ps.latest().version == 1  # 'latest' is the newest complete version

    result: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: result.update(ps_pull_waiting(ps.url, 2)))
    waiter.start()
    send_all_chunks(ps.url, session, begin)
    ps.http.post("/v1/params/2/commit", params={"push_id": begin["push_id"]}).raise_for_status()
    waiter.join(30)
    assert_same(result, pushed)


def ps_pull_waiting(url: str, version: int) -> dict[str, object]:
    with ParamsClient(url) as client:
        return client.pull(version, wait_s=30)


def start_raw_push(ps: ParamsClient, version: int, tensors: dict[str, object]) -> tuple[dict, list]:
    from staleflow.transports.client import _as_bytes
    from staleflow.transports.layout import layout_tensors

    converted = [(n, *_as_bytes(v)) for n, v in tensors.items()]
    response = ps.http.post(f"/v1/params/{version}", json={
        "tensors": [{"name": n, "dtype": d, "shape": list(s)} for n, d, s, _ in converted]})
    response.raise_for_status()
    laid = layout_tensors([(n, d, s) for n, d, s, _ in converted])
    return response.json(), [ByteRegions.per_tensor(laid, {n: b for n, _, _, b in converted})]


def send_all_chunks(url: str, session: list, begin: dict, corrupt: int | None = None) -> list[int]:
    source: ByteRegions = session[0]
    statuses = []
    with RawHttpConnection(url) as conn:
        for chunk in plan_chunks(begin["total_bytes"], begin["chunk_bytes"]):
            views = source.views(chunk.offset, chunk.length)
            checksum = checksum_of("crc32", views)
            if chunk.index == corrupt:
                checksum = "crc32:00000000"
            status, _, _ = conn.request("PUT", f"/v1/params/{begin['version']}/chunks/{chunk.index}?push_id={begin['push_id']}",
                                        {CHECKSUM_HEADER: checksum}, views)
            statuses.append(status)
    return statuses


def test_refusals_are_4xx_with_a_reason(ps: ParamsClient) -> None:
    pushed = state_dict(1)
    begin, session = start_raw_push(ps, 1, pushed)
    statuses = send_all_chunks(ps.url, session, begin, corrupt=2)
    assert statuses[2] == 422 and statuses.count(200) == len(statuses) - 1
    commit = ps.http.post("/v1/params/1/commit", params={"push_id": begin["push_id"]})
    assert commit.status_code == 409 and "chunks missing: 2" in commit.json()["detail"]
    assert ps.http.get("/v1/params/1/manifest").status_code == 409  # not visible: being pushed

    with RawHttpConnection(ps.url) as conn:  # the payload limit: one chunk's size
        status, _, body = conn.request("PUT", f"/v1/params/1/chunks/0?push_id={begin['push_id']}",
                                       {CHECKSUM_HEADER: "crc32:00000000"}, [memoryview(bytes(CHUNK + 1))])
        assert status == 413, body
        status, _, body = conn.request("PUT", f"/v1/params/1/chunks/0?push_id={begin['push_id']}", {},
                                       [memoryview(bytes(CHUNK))])
        assert status == 422 and b"x-staleflow-checksum" in body
    assert ps.http.put("/v1/params/1/chunks/0", params={"push_id": "other"}, content=b"x",
                       headers={CHECKSUM_HEADER: "crc32:0"}).status_code == 409

    # the push is repaired by resending the bad chunk, then commits
    source: ByteRegions = session[0]
    chunk = plan_chunks(begin["total_bytes"], begin["chunk_bytes"])[2]
    views = source.views(chunk.offset, chunk.length)
    with RawHttpConnection(ps.url) as conn:
        status, _, _ = conn.request("PUT", f"/v1/params/1/chunks/2?push_id={begin['push_id']}",
                                    {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
    assert status == 200
    ps.http.post("/v1/params/1/commit", params={"push_id": begin["push_id"]}).raise_for_status()
    assert_same(ps.pull(1), pushed)

    def status_of(method: str, path: str, **kwargs: object) -> tuple[int, str]:
        response = ps.http.request(method, path, **kwargs)
        return response.status_code, str(response.json()["detail"])

    assert status_of("GET", "/v1/params/9/manifest") == (404, "version 9 has not been pushed (kept: [1])")
    assert status_of("POST", "/v1/params/9/pulls", json={})[0] == 404
    assert status_of("GET", "/v1/params/nope/manifest")[0] == 422
    assert status_of("POST", "/v1/params/1", json={"tensors": [{"name": "a", "dtype": "F32", "shape": [1]}]})[0] == 409
    assert status_of("POST", "/v1/params/0", json={"tensors": [{"name": "a", "dtype": "F32", "shape": [1]}]})[0] == 409
    assert status_of("POST", "/v1/params/5", json={"tensors": [{"name": "a", "dtype": "F31", "shape": [1]}]})[0] == 422
    assert status_of("POST", "/v1/params/5", json={"tensors": [{"name": "a", "dtype": "F32", "shape": [-1]}]})[0] == 422
    assert status_of("POST", "/v1/params/5", json={"tensors": []})[0] == 422
    assert status_of("POST", "/v1/params/5/commit", params={"push_id": "x"})[0] == 404
    assert status_of("POST", "/v1/params/1/pulls", json={"transport": "carrier-pigeon"})[0] == 422
    assert status_of("GET", "/v1/params/1/chunks/999")[0] == 404
    assert status_of("GET", "/v1/params/1/chunks/0", params={"lease": "bogus"})[0] == 404
    assert status_of("DELETE", "/v1/pulls/bogus")[0] == 404
    with pytest.raises(FormatError, match="holds"):
        ps.pull(1, out={k: np.empty(1, np.uint8) for k in pushed})


def test_pushes_need_the_token_when_one_is_set(tmp_path: Path) -> None:
    with serve_in_thread(create_app(config(tmp_path)), token="s3cret") as server:
        with ParamsClient(server.url, token="wrong") as intruder, pytest.raises(ServiceError) as refused:
            intruder.push(1, state_dict(1))
        assert refused.value.status == 401
        with ParamsClient(server.url, token="s3cret") as trainer:
            trainer.push(1, state_dict(1))  # the chunk uploads carry it too
            assert_same(trainer.pull(1, "shm"), state_dict(1))


def test_one_server_per_state_directory(tmp_path: Path) -> None:
    store = ParamStore(config(tmp_path))
    try:
        with pytest.raises(OSError, match="another parameter server"):
            ParamStore(config(tmp_path))
    finally:
        store.close()
    ParamStore(config(tmp_path)).close()  # closing released it


def test_version_specs_and_retention_rule() -> None:
    assert parse_version_spec("42") == ("exact", 42)
    assert parse_version_spec("latest") == ("latest", 0)
    assert parse_version_spec("latest-3") == ("latest", 3)
    for bad in ("-1", "latest+1", "newest", ""):
        with pytest.raises(ParamsError):
            parse_version_spec(bad)
    assert versions_to_drop([5, 1, 3, 4], keep=2) == [1, 3]
    assert versions_to_drop([1], keep=3) == []


# ---------------------------------------------------------------- crash and restart


def serve_params_command() -> list[str]:
    # `staleflow serve params` once cli/main.py registers it; the module itself until then
    from staleflow.cli.main import serve_app

    if any(c.name == "params" for c in serve_app.registered_commands):
        return [sys.executable, "-m", "staleflow.cli", "serve", "params"]
    return [sys.executable, "-m", "staleflow.cli.serve_params"]


def start_ps(state_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*serve_params_command(), "--state-dir", str(state_dir), "--port", str(port), "--keep", "3",
         "--chunk-mb", str(CHUNK / (1 << 20)), *extra],
        stderr=subprocess.PIPE, text=True,
    )
    for line in proc.stderr:  # the socket listens before this line; requests queue until served
        if "listening on" in line:
            break
    else:
        raise AssertionError(f"parameter server exited early with {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc


def test_complete_versions_survive_sigkill_mid_push(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_ps(tmp_path, port)
    try:
        with ParamsClient(url) as client:
            client.push(1, state_dict(1))
            client.push(2, state_dict(2))
            assert client.wait_persisted(1, 60) and client.wait_persisted(2, 60)
            begin, session = start_raw_push(client, 3, state_dict(3, scale=4))
            source: ByteRegions = session[0]
            with RawHttpConnection(url) as conn:
                for chunk in plan_chunks(begin["total_bytes"], begin["chunk_bytes"])[:5]:
                    views = source.views(chunk.offset, chunk.length)
                    status, _, _ = conn.request("PUT", f"/v1/params/3/chunks/{chunk.index}?push_id={begin['push_id']}",
                                                {CHECKSUM_HEADER: checksum_of("crc32", views)}, views)
                    assert status == 200
                # the next chunk is half sent when the process dies
                views = source.views(begin["chunk_bytes"] * 5, begin["chunk_bytes"])
                conn.send("PUT", f"/v1/params/3/chunks/5?push_id={begin['push_id']}", {CHECKSUM_HEADER: "crc32:0"})
                conn._connection().sock.sendall(views[0][: len(views[0]) // 2])
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        # memory first: the push in progress lived in shared memory only, nothing of it is on disk
        assert sorted(p.name for p in (tmp_path / "versions").iterdir()) == ["v0000000001", "v0000000002"]

        proc = start_ps(tmp_path, port)
        with ParamsClient(url) as client:
            assert [v.version for v in client.versions().versions] == [1, 2]
            assert not any(p.name.startswith(".") for p in (tmp_path / "versions").iterdir())
            assert_same(client.pull(1, "http"), state_dict(1))
            assert_same(client.pull(2, "shm"), state_dict(2))  # republished to shared memory on demand
            with pytest.raises(ServiceError) as missing:
                client.pull(3)
            assert missing.value.status == 404
            client.push(3, state_dict(3))  # the interrupted version can be pushed again
            assert_same(client.pull("latest"), state_dict(3))
        segments = [p for p in Path("/dev/shm").glob(shm_prefix(tmp_path) + "-slot*") if p.suffix != ".stamp"]
        assert segments  # the killed server's segments were replaced, not added to
        assert len(segments) <= 3 + 1
        proc.terminate()  # a clean stop removes them
        proc.wait(30)
        assert not list(Path("/dev/shm").glob(shm_prefix(tmp_path) + "-slot*"))
    finally:
        proc.kill()
        proc.wait(10)


def test_client_errors_name_the_fix(ps: ParamsClient) -> None:
    with pytest.raises(ServiceError) as none_yet:
        ps.latest()
    assert none_yet.value.status == 404 and "no complete version" in none_yet.value.detail
    with pytest.raises(httpx.HTTPError), ParamsClient("http://127.0.0.1:1", timeout=2) as dead:
        dead.health()


def test_a_version_not_yet_persisted_is_lost_whole_on_sigkill(tmp_path: Path) -> None:
    """Visible from memory first, on disk later: a PS killed in between serves the newest
    persisted version again, and a persist cut short leaves only a staging folder that the next
    start discards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_ps(tmp_path, port)
    try:
        with ParamsClient(url) as client:
            client.push(1, state_dict(1))
            assert client.wait_persisted(1, 60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = start_ps(tmp_path, port, "--no-persist")
        with ParamsClient(url) as client:
            client.push(2, state_dict(2))
            assert client.latest().version == 2
            assert [(v.version, v.persisted) for v in client.versions().versions] == [(1, True), (2, False)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        torn = tmp_path / "versions" / ".staging-v0000000002-killed"  # what a persist cut short leaves
        torn.mkdir()
        (torn / "model.safetensors").write_bytes(b"\0" * 1000)
        proc = start_ps(tmp_path, port)
        with ParamsClient(url) as client:
            assert client.latest().version == 1
            assert_same(client.pull("latest", "shm"), state_dict(1))
            assert not torn.exists()
            client.push(2, state_dict(2))  # the trainer pushes the lost version again
            assert_same(client.pull(2, "http"), state_dict(2))
        proc.terminate()  # a clean stop removes its shared-memory slots
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait(10)


def test_a_deleted_version_is_refused_at_once_and_freed_when_its_readers_end(ps: ParamsClient, tmp_path: Path) -> None:
    ps.push(1, state_dict(1))
    ps.push(2, state_dict(2))
    assert ps.wait_persisted(2, 60)
    reading = ps.open_pull(2, "shm")
    answer = ps.delete_version(2)
    assert answer == VersionDeleted(version=2, deleted=False, readers=1)
    assert ps.latest().version == 1  # the newest kept version is the one before
    with pytest.raises(ServiceError) as refused:
        ps.open_pull(2)
    assert refused.value.code is ErrorCode.UNKNOWN_VERSION
    assert_same(dict(ps.receive(reading)), state_dict(2))  # an open pull still reads it whole
    ps.close_pull(reading)
    assert [v.version for v in ps.versions().versions] == [1]
    assert "v0000000002" not in {p.name for p in (tmp_path / "versions").iterdir()}
    slots_before = ps.versions().shm["slots"]
    ps.push(3, state_dict(3))  # takes the freed memory slot (same size) instead of a new one
    assert ps.versions().shm["slots"] == slots_before
    assert ps.wait_persisted(3, 60)
    assert ps.delete_version(3) == VersionDeleted(version=3, deleted=True, readers=0)
    with pytest.raises(ServiceError) as again:
        ps.delete_version(3)
    assert again.value.code is ErrorCode.UNKNOWN_VERSION
