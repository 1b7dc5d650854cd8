"""Reference-oriented storage over real servers on loopback: holders (parameter servers started
with ``holder_of``) pull a version from each other chunk by chunk and serve what they hold over
http and shm; the parameter server drops its copy once enough holders hold it and takes one back
before the last holder unpublishes; a holder SIGKILLed mid-transfer costs a retry, never a
corrupt byte; a restarted parameter server rebuilds its holders from their heartbeats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from support import ParamsProcess

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes as API
from staleflow.errors import ErrorCode
from staleflow.servers.http import RunningServer, serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.servers.params.rules import shm_prefix
from staleflow.transports import TensorSlice
from staleflow.transports.client import ParamsClient
from staleflow.transports.http import RawHttpConnection

CHUNK = 64 << 10


def weights(version: int, floats: int = 300_000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {"embed.weight": rng.standard_normal((floats // 100, 100)).astype(np.float32),
            "norm.weight": rng.standard_normal(777).astype(np.float16)}


def same(pulled: dict, pushed: dict) -> bool:
    return set(pulled) == set(pushed) and all(np.asarray(pulled[k]).tobytes() == v.tobytes() for k, v in pushed.items())


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s:g} s"
        time.sleep(0.05)  # polling pace


def reference(stack: ExitStack, tmp_path: Path, **settings: object) -> RunningServer:
    config = ParamsConfig(state_dir=tmp_path / "ps", port=0, persist=False, chunk_bytes=CHUNK, holder_ttl_s=4, **settings)
    return stack.enter_context(serve_in_thread(create_app(config)))


def holder(stack: ExitStack, tmp_path: Path, ps_url: str, name: str, **settings: object) -> RunningServer:
    config = ParamsConfig(state_dir=tmp_path / name, port=0, persist=False, holder_of=ps_url, holder_id=name,
                          holder_follows=False, keep=1, holder_ttl_s=4, **settings)
    return stack.enter_context(serve_in_thread(create_app(config)))


def pull_on(url: str, version: int | str) -> dict:
    with ParamsClient(url, timeout=120) as client:
        return client.json(API.holder_pull, str(version))


def test_a_burst_of_holders_forms_a_chain_serves_http_and_shm_and_the_ps_drops_its_copy(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = reference(stack, tmp_path, retain_replicas=2)
        holders = [holder(stack, tmp_path, ps.url, f"h{i}") for i in range(4)]
        pushed = weights(1)
        client = stack.enter_context(ParamsClient(ps.url))
        chunks = client.push(1, pushed)["chunks"]
        results: dict[str, dict] = {}
        threads = [threading.Thread(target=lambda h=h: results.update({h.url: pull_on(h.url, 1)})) for h in holders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        from_ps = sum(r["fetched"].get("ps", 0) for r in results.values())
        assert len(results) == 4 and all(sum(r["fetched"].values()) == chunks for r in results.values())
        assert from_ps < 2 * chunks, f"the PS sent {from_ps} chunks to 4 pullers of {chunks}: a fan-out, not a chain"

        # every holder serves what it holds through the parameter server's own transports
        rows = pushed["embed.weight"].shape[0]
        for h in holders:
            with ParamsClient(h.url) as local:
                assert same(local.pull(1, "shm"), pushed) and same(local.pull(1, "http"), pushed)
                part = local.pull(1, "http", select={"embed.weight": TensorSlice(1, 1, 4)})
                assert part["embed.weight"].tobytes() == np.array_split(pushed["embed.weight"], 4, axis=1)[1].tobytes()
                rows_part = local.pull(1, "shm", select={"embed.weight": TensorSlice(0, 0, 2)})
                assert rows_part["embed.weight"].tobytes() == pushed["embed.weight"][: (rows + 1) // 2].tobytes()

        # enough non-spot holders hold it: the PS drops its host copy, pullers get it from the holders
        wait_until(lambda: client.json(API.references)["ps_copies"] == [], "the PS to drop its copy")
        assert client.versions().versions == []
        assert client.latest().version == 1, "a version only holders hold is still the newest"
        assert same(client.pull(1, sources="ros"), pushed)
        with pytest.raises(ServiceError) as refused:
            client.pull(1)
        assert refused.value.code is ErrorCode.VERSION_HELD_BY_PEERS
        # withdrawn while only its holders hold it: nobody is sent to them for it any more
        assert client.delete_version(1).deleted
        with pytest.raises(ServiceError) as withdrawn:
            client.pull(1, sources="ros")
        assert withdrawn.value.code is ErrorCode.UNKNOWN_VERSION


def test_the_ps_takes_a_copy_back_before_the_last_holder_unpublishes(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = reference(stack, tmp_path, retain_replicas=1)
        only = holder(stack, tmp_path, ps.url, "only")
        pushed = weights(2)
        client = stack.enter_context(ParamsClient(ps.url))
        client.push(2, pushed)
        pull_on(only.url, 2)
        wait_until(lambda: client.json(API.references)["ps_copies"] == [], "the PS to drop its copy")
        holder_client = stack.enter_context(ParamsClient(only.url))
        holder_client.json(API.holder_drop, 2)  # returns only once the PS holds a copy again
        assert client.json(API.references)["ps_copies"] == [2]
        assert [v.version for v in client.versions().versions] == [2]
        assert same(client.pull(2), pushed)
        # the holder's lease on it ended: its reads after the unpublish are refused
        with RawHttpConnection(_data_url(holder_client)) as conn:
            status, _, body = conn.request("GET", API.chunk.target(2, 0))
        assert status == 404 and b"unknown_version" in body


def test_a_corrupt_chunk_from_a_holder_is_fetched_again_from_another_source(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = reference(stack, tmp_path, retain_replicas=2)
        shm_dir = tmp_path / "holder-shm"
        shm_dir.mkdir()
        bad = holder(stack, tmp_path, ps.url, "bad", shm_dir=shm_dir)
        pushed = weights(3)
        client = stack.enter_context(ParamsClient(ps.url))
        chunks = client.push(3, pushed)["chunks"]
        pull_on(bad.url, 3)
        (slot,) = [p for p in shm_dir.iterdir() if not p.name.endswith(".stamp")]
        with open(slot, "r+b") as data:  # flip a byte of the holder's copy in place
            data.seek(8192)
            byte = data.read(1)
            data.seek(8192)
            data.write(bytes([byte[0] ^ 0xFF]))
        assert same(client.pull(3, sources="ros"), pushed)
        peers = client.transport("ros")
        assert [(source, "checksum" in why) for _, source, why in peers.failures] == [("bad", True)]  # type: ignore[attr-defined]
        # its first chunk is corrupt: the holder is not asked again in this pull
        assert peers.fetched == {"ps": chunks}  # type: ignore[attr-defined]


def test_a_holder_sigkilled_mid_pull_costs_a_retry_never_a_corrupt_byte(tmp_path: Path) -> None:
    # a ttl no heartbeat misses on a loaded machine: a victim declared failed before the pull would
    # never be offered as a source (its death is found by the connection it breaks, not by the ttl)
    ps = ParamsProcess(tmp_path / "ps", "--chunk-mb", str(CHUNK / (1 << 20)), "--holder-ttl", "60", "--retain-replicas", "2")
    victim = ParamsProcess(tmp_path / "victim", "--holder-of", ps.url, "--holder-id", "victim", "--no-holder-follows",
                           "--keep", "1", "--holder-ttl", "60")
    try:
        ps.start(persist=False)
        victim.start(persist=False)
        pushed = weights(4, floats=8_000_000)  # 32 MB: 489 chunks, pulled over a second or more here
        with ParamsClient(ps.url, timeout=120) as client:
            chunks = client.push(4, pushed)["chunks"]
            pull_on(victim.url, 4)
            pulled: dict = {}
            puller = threading.Thread(target=lambda: pulled.update(client.pull(4, sources="ros")))
            puller.start()
            peers = client.transport("ros")
            wait_until(lambda: peers.fetched.get("victim", 0) >= 20, "the puller to read from the victim")  # type: ignore[attr-defined]
            victim.kill()
            puller.join(120)
            assert same(pulled, pushed), "byte-exact after the holder died mid-transfer"
            from_victim, from_ps = peers.fetched.get("victim", 0), peers.fetched.get("ps", 0)  # type: ignore[attr-defined]
            assert from_victim + from_ps == chunks and from_victim < chunks
            assert 1 <= len(peers.failures) <= 2, peers.failures  # type: ignore[attr-defined]
    finally:
        victim.stop()
        ps.stop()
        remove_left_segments(victim)


def test_a_restarted_ps_rebuilds_its_holders_from_their_heartbeats(tmp_path: Path) -> None:
    ps = ParamsProcess(tmp_path / "ps", "--chunk-mb", str(CHUNK / (1 << 20)), "--holder-ttl", "2", "--retain-replicas", "2")
    holders = [ParamsProcess(tmp_path / f"h{i}", "--holder-of", ps.url, "--holder-id", f"h{i}", "--no-holder-follows",
                             "--keep", "1", "--holder-ttl", "2") for i in range(2)]
    try:
        ps.start(persist=False)
        for h in holders:
            h.start(persist=False)
        pushed = weights(5)
        with ParamsClient(ps.url) as client:
            client.push(5, pushed)
            for h in holders:
                pull_on(h.url, 5)
            wait_until(lambda: client.json(API.references)["ps_copies"] == [], "the PS to drop its copy")
        ps.kill()
        ps.start(persist=False)  # nothing on disk: all it learns comes from the holders
        with ParamsClient(ps.url) as client:
            rebuilt = wait_until(lambda: _holders_of(client, 5) == {"h0", "h1"}, "the holders' next heartbeats")
            assert rebuilt
            assert client.latest().version == 5
            assert same(client.pull(5, sources="ros"), pushed)
            assert client.json(API.references)["ps_copies"] == [], "two holders hold it: no copy taken back"
    finally:
        for h in holders:
            h.stop()
        ps.stop()


def remove_left_segments(process: ParamsProcess) -> None:
    """The shared memory a SIGKILLed server left (a start on its state directory would remove it)."""
    for left in Path("/dev/shm").glob(f"{shm_prefix(process.state_dir)}-slot*"):
        left.unlink(missing_ok=True)


def _holders_of(client: ParamsClient, version: int) -> set[str]:
    described = client.json(API.references)
    return {h["holder_id"] for h in described["holders"] if str(version) in h["versions"]}


def _data_url(client: ParamsClient) -> str:
    url = client._data_url()
    assert url is not None
    return url
