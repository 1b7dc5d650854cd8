"""Holders serve their peers over shm and nixl, not only http, over real server processes on
loopback: a holder on the puller's host is read out of its shared-memory slot (whole, selected and
tensor-parallel sliced pulls byte-exact), also while it is still pulling the version itself
(pipeline replication: the reader waits for each chunk with a HEAD on the holder's data plane); a
holder SIGKILLed mid-pull costs a retry of the chunk in flight, never a corrupt byte; a holder that
unpublishes does not reuse a slot a peer's lease still reads; and the same over nixl."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from support import ParamsProcess
from test_ros import CHUNK, holder, pull_on, reference, remove_left_segments, same, wait_until, weights

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes as API
from staleflow.api.params import PeerRoutes
from staleflow.errors import ErrorCode
from staleflow.transports import TensorSlice
from staleflow.transports.base import PullLease
from staleflow.transports.client import ParamsClient
from staleflow.transports.errors import TransportUnavailable
from staleflow.transports.http import LANDED_THROUGH_HEADER, RawHttpConnection
from staleflow.transports.nixl import nixl_available
from staleflow.transports.peer_reads import PeerCopy
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import ShmTransport

SLOW_GBPS = "0.05"  # the PS's emulated NIC: a 4 MB version takes 0.64 s to leave it, long enough to join mid-pull


def servers(tmp_path: Path, holders: int, *options: str, ps_options: tuple[str, ...] = ()) -> list[ParamsProcess]:
    ps = ParamsProcess(tmp_path / "ps", "--chunk-mb", str(CHUNK / (1 << 20)), "--holder-ttl", "4", "--retain-replicas", "2",
                       *ps_options)
    peers = [ParamsProcess(tmp_path / f"h{i}", "--holder-of", ps.url, "--holder-id", f"h{i}", "--no-holder-follows",
                           "--keep", "1", "--holder-ttl", "4", *options) for i in range(holders)]
    return [ps, *peers]


def start(processes: list[ParamsProcess]) -> None:
    processes[0].start(persist=False)
    for process in processes[1:]:
        process.start(persist=False)


def stop(processes: list[ParamsProcess]) -> None:
    for process in reversed(processes):
        process.stop()
        remove_left_segments(process)


def held_chunks(client: ParamsClient, holder: str, version: int) -> int | None:
    """The chunks the reference server knows ``holder`` holds of ``version`` (None: all)."""
    for record in client.json(API.references)["holders"]:
        if record["holder_id"] == holder:
            return record["versions"].get(str(version), 0)
    return 0


def join_mid_pull(client: ParamsClient, first: ParamsProcess, second: ParamsProcess, version: int) -> dict[str, dict]:
    """``first`` pulls ``version`` (from the PS, through its slow link) and ``second`` joins while
    it still pulls: the replies of both holders' pulls."""
    replies: dict[str, dict] = {}
    done: dict[str, float] = {}
    leader = threading.Thread(target=lambda: (replies.update(first=pull_on(first.url, version)),
                                              done.update(first=time.monotonic())))
    leader.start()
    wait_until(lambda: (held_chunks(client, "h0", version) or 0) >= 8, "the first holder to land chunks")
    joined = time.monotonic()
    replies["second"] = pull_on(second.url, version)
    leader.join(60)
    assert joined < done["first"], "the second holder joined while the first still pulled"
    return replies


def check_every_read(client: ParamsClient, version: int, pushed: dict, transport: str) -> None:
    """Whole, selected and tensor-parallel sliced pulls from the holders, byte-exact."""
    assert same(client.pull(version, transport, sources="ros"), pushed)
    part = client.pull(version, transport, sources="ros", select={"embed.weight": TensorSlice(1, 1, 4)})
    assert part["embed.weight"].tobytes() == np.array_split(pushed["embed.weight"], 4, axis=1)[1].tobytes()
    rows = client.pull(version, transport, sources="ros", select={"embed.weight": TensorSlice(0, 1, 2), "norm.weight": None})
    half = (pushed["embed.weight"].shape[0] + 1) // 2
    assert rows["embed.weight"].tobytes() == pushed["embed.weight"][half:].tobytes()
    assert rows["norm.weight"].tobytes() == pushed["norm.weight"].tobytes()


def test_a_holder_on_the_pullers_host_is_read_over_shm_also_while_it_pulls(tmp_path: Path) -> None:
    processes = servers(tmp_path, 2, ps_options=("--egress-gbps", SLOW_GBPS))
    ps, first, second = processes
    try:
        start(processes)
        pushed = weights(1, floats=1_000_000)  # 4 MB, 62 chunks
        with ParamsClient(ps.url, timeout=120) as client:
            chunks = client.push(1, pushed)["chunks"]
            replies = join_mid_pull(client, first, second, 1)  # from the first, over shm, as its chunks land
            assert replies["first"]["fetched"] == {"ps": chunks}
            assert replies["second"]["fetched"] == {"h0": chunks} and replies["second"]["via"] == {"shm": chunks}
            for holder in (first, second):
                with ParamsClient(holder.url) as local:
                    assert same(local.pull(1, "shm"), pushed)
            check_every_read(client, 1, pushed, "auto")
            peers = client.transport("ros")
            assert set(peers.fetched) <= {"h0", "h1"} and set(peers.fetched_via) == {"shm"}  # type: ignore[attr-defined]
            # asked for http, the same holders are read over http
            assert same(client.pull(1, "http", sources="ros"), pushed)
            assert peers.fetched_via["http"] == chunks  # type: ignore[attr-defined]
    finally:
        stop(processes)


def test_a_holder_sigkilled_while_a_peer_reads_it_over_shm_costs_a_retry_never_a_corrupt_byte(tmp_path: Path) -> None:
    processes = servers(tmp_path, 2, ps_options=("--egress-gbps", SLOW_GBPS))
    ps, victim, survivor = processes
    try:
        start(processes)
        pushed = weights(2, floats=1_000_000)
        with ParamsClient(ps.url, timeout=120) as client:
            chunks = client.push(2, pushed)["chunks"]
            threading.Thread(target=lambda: _suppressed(pull_on, victim.url, 2), daemon=True).start()  # dies with it
            wait_until(lambda: (held_chunks(client, "h0", 2) or 0) >= 4, "the victim to land chunks")
            reply: dict = {}
            follower = threading.Thread(target=lambda: reply.update(pull_on(survivor.url, 2)))
            follower.start()
            wait_until(lambda: (held_chunks(client, "h1", 2) or 0) >= 8, "the survivor to read from the victim")
            victim.kill()  # mid-pull: the survivor waits on it for chunks it has not landed yet
            follower.join(120)
            from_victim, from_ps = reply["fetched"].get("h0", 0), reply["fetched"].get("ps", 0)
            assert from_victim + from_ps == chunks and 8 <= from_victim < chunks, reply
            assert reply["via"] == {"shm": from_victim, "http": from_ps}, reply
            assert 1 <= reply["failures"] <= 2, reply
            with ParamsClient(survivor.url) as local:
                assert same(local.pull(2, "shm", verify="checksum"), pushed), "byte-exact after its source died mid-transfer"
    finally:
        stop(processes)


def _suppressed(call: object, *args: object) -> None:
    with contextlib.suppress(Exception):
        call(*args)  # type: ignore[operator]


def test_an_unpublished_copy_keeps_its_slot_while_a_peer_lease_reads_it(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = reference(stack, tmp_path)
        only = holder(stack, tmp_path, ps.url, "only")
        first, second = weights(3), weights(4)
        client = stack.enter_context(ParamsClient(ps.url, timeout=120))
        local = stack.enter_context(ParamsClient(only.url))
        client.push(3, first)
        pull_on(only.url, 3)
        data_url = local._data_url()
        assert data_url is not None
        conn = stack.enter_context(RawHttpConnection(data_url))
        status, _, body = conn.request("POST", PeerRoutes.open_lease.target(3, transport="shm"))
        assert status == 201, body
        granted = json.loads(body)
        assert granted["held"] is None
        local.json(API.holder_drop, 3)  # unpublished: the PS still holds a copy, so at once
        status, _, body = conn.request("POST", PeerRoutes.open_lease.target(3, transport="shm"))
        assert status == 404 and b"unknown_version" in body, "no new reads of an unpublished copy"
        client.push(4, second)
        pull_on(only.url, 4)  # keep 1: a slot of its own, not the one the lease reads
        manifest = client.manifest(3)
        lease = PullLease(granted["lease_id"], manifest, "shm", granted["details"], granted["ttl_s"])
        out = np.empty(manifest.total_bytes, np.uint8)
        reader = stack.enter_context(contextlib.closing(ShmTransport(workers=1)))
        for chunk in manifest.chunks:  # the stamp is checked after each chunk: the slot was not reused
            reader.read_chunk(lease, chunk, ByteRegions.flat(out), "auto")
        assert out.tobytes() == b"".join(first[name].tobytes() for name in ("embed.weight", "norm.weight"))
        status, _, body = conn.request("DELETE", PeerRoutes.close_lease.target(granted["lease_id"]))
        assert status == 200, body
        assert same(local.pull(4, "shm"), second)
        with pytest.raises(ServiceError) as gone:
            local.pull(3, "shm")
        assert gone.value.code is ErrorCode.UNKNOWN_VERSION


@pytest.mark.slow  # three server processes loading NIXL (and torch): about 20 s on the 2-core machine
@pytest.mark.skipif(not nixl_available()[0], reason=nixl_available()[1])
def test_holders_read_each_other_over_nixl_also_while_they_pull(tmp_path: Path) -> None:
    processes = servers(tmp_path, 2, "--transports", "http,shm,nixl", "--peer-transport", "nixl",
                        ps_options=("--egress-gbps", SLOW_GBPS))
    ps, first, second = processes
    try:
        start(processes)
        pushed = weights(5, floats=1_000_000)
        with ParamsClient(ps.url, timeout=120) as client:
            chunks = client.push(5, pushed)["chunks"]
            replies = join_mid_pull(client, first, second, 5)
            assert replies["second"]["fetched"] == {"h0": chunks} and replies["second"]["via"] == {"nixl": chunks}
            with ParamsClient(second.url) as local:
                assert same(local.pull(5, "shm"), pushed)
            check_every_read(client, 5, pushed, "nixl")
            assert set(client.transport("ros").fetched_via) == {"nixl"}  # type: ignore[attr-defined]
    finally:
        stop(processes)


def test_the_peer_routes_answer_bad_requests_with_the_error_body_and_a_disabled_transport_means_http(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = reference(stack, tmp_path)
        plain = holder(stack, tmp_path, ps.url, "plain", transports=("http",))
        client = stack.enter_context(ParamsClient(ps.url, timeout=120))
        pushed = weights(6)
        chunks = client.push(6, pushed)["chunks"]
        pull_on(plain.url, 6)
        data_url = stack.enter_context(ParamsClient(plain.url))._data_url()
        assert data_url is not None
        conn = stack.enter_context(RawHttpConnection(data_url))
        manifest = client.manifest(6)
        with pytest.raises(TransportUnavailable, match="shm"):  # the reader falls back to http for this holder
            PeerCopy(conn, manifest, "shm", ShmTransport(workers=1), "auto")
        status, _, body = conn.request("POST", PeerRoutes.open_lease.target(99, transport="shm"))
        assert status == 422 and json.loads(body)["code"] == "transport_disabled"
        status, _, body = conn.request("DELETE", PeerRoutes.close_lease.target("ab12"))
        assert status == 404 and json.loads(body)["code"] == "unknown_lease"
        conn.send("HEAD", PeerRoutes.chunk_landed.target(6, 0))  # a whole copy: every chunk has landed
        status, headers = conn.read_head()
        assert status == 200 and int(headers[LANDED_THROUGH_HEADER]) == chunks
        status, _, body = conn.request("HEAD", PeerRoutes.chunk_landed.target(6, chunks))
        assert status == 404 and json.loads(body)["code"] == "unknown_chunk"
        # a pull asking for shm reads this holder over http: it offers no shm
        assert same(client.pull(6, "shm", sources="ros"), pushed)
        peers = client.transport("ros")
        assert peers.fetched == {"plain": chunks} and peers.fetched_via == {"http": chunks}  # type: ignore[attr-defined]
