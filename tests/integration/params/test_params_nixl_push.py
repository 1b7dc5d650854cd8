"""Pushes over NIXL: ranks WRITE their parts into the PS's memory slot; the PS hashes what landed
against the checksums the ranks computed over their own bytes before a part counts as done. A
version is visible only whole and verified; a refused or killed pusher leaves nothing visible;
the slot's registration goes when the push commits, is dropped or the PS stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from test_params_sharded import dim0_share, full_state, table

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes
from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, ParamStore, create_app
from staleflow.transports.base import PushSession
from staleflow.transports.checksums import checksum_algorithms
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.nixl import nixl_available
from staleflow.transports.regions import ByteRegions

pytestmark = pytest.mark.skipif(not nixl_available()[0], reason=nixl_available()[1])

CHUNK = 64 << 10


@contextmanager
def params_server(tmp_path: Path) -> Iterator[tuple[str, ParamStore]]:
    """A PS with every transport on loopback, and its store (to see its NIXL registrations)."""
    config = ParamsConfig(state_dir=tmp_path / "ps", port=0, chunk_bytes=CHUNK, fsync=False, keep=3,
                          transports=("http", "shm", "nixl"))
    store = ParamStore(config)
    with serve_in_thread(create_app(config, store=store, owns_store=True)) as server:
        yield server.url, store


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[tuple[str, ParamStore]]:
    with params_server(tmp_path) as running:
        yield running


def registered_pushes(store: ParamStore) -> int:
    assert store.nixl is not None
    return store.nixl.registrations()["pushes"]


RANK = """
import json, sys
import numpy as np
from staleflow.transports.client import ParamsClient, ShardPiece
url, share, part, parts, via = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
arrays = np.load(share["arrays"])
pieces = [ShardPiece(name, start, arrays[name]) for name, start in share["starts"].items()]
tensors = {name: (dtype, tuple(shape)) for name, (dtype, shape) in share["table"].items()}
with ParamsClient(url) as client:
    reply = client.push_part(share["version"], part, parts, tensors, pieces, transport=via, wait_s=60)
print(json.dumps({"visible": reply["visible"], "via": reply["via"]}), flush=True)
"""


def start_rank(url: str, tmp_path: Path, version: int, state: dict[str, np.ndarray], part: int, parts: int,
               via: str) -> subprocess.Popen:
    """A trainer rank in its own process, holding its dim-0 shard of ``state``."""
    pieces = dim0_share(state, part, parts)
    arrays = tmp_path / f"rank{part}.npz"
    np.savez(arrays, **{p.name: p.data for p in pieces})
    share = {"version": version, "arrays": str(arrays), "starts": {p.name: p.start for p in pieces},
             "table": {name: [dtype, list(shape)] for name, (dtype, shape) in table(state).items()}}
    return subprocess.Popen([sys.executable, "-c", RANK, url, json.dumps(share), str(part), str(parts), via],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("vias", [("nixl", "nixl", "nixl"), ("nixl", "shm", "http")], ids=["all-nixl", "mixed"])
def test_a_sharded_push_over_nixl_pulls_back_byte_exact(ps: tuple[str, ParamStore], tmp_path: Path,
                                                         vias: tuple[str, ...]) -> None:
    url, store = ps
    state = full_state(11)
    ranks = [start_rank(url, tmp_path, 7, state, part, len(vias), via) for part, via in enumerate(vias)]
    replies = []
    for rank in ranks:
        out, _ = rank.communicate(timeout=120)
        assert rank.returncode == 0
        replies.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["via"] for r in replies] == list(vias) and all(r["visible"] for r in replies)
    with ParamsClient(url) as client:
        manifest = client.manifest(7)
        position = 0
        for chunk in manifest.chunks:  # the parts' chunks tile the data section
            assert chunk.offset == position and chunk.checksum
            position += chunk.length
        assert position == manifest.total_bytes
        for transport in ("shm", "http", "nixl"):
            pulled = client.pull(7, transport)
            assert set(pulled) == set(state)
            for name, array in state.items():
                assert pulled[name].shape == array.shape and pulled[name].tobytes() == array.tobytes(), (transport, name)
    assert registered_pushes(store) == 0  # the commit released the slot's registration


def test_an_auto_push_off_the_ps_host_goes_over_the_remote_transport_asked_for(tmp_path: Path) -> None:
    # a PS that offers no shared memory is, to its pushers, a PS on another host
    config = ParamsConfig(state_dir=tmp_path / "ps", port=0, chunk_bytes=CHUNK, fsync=False, keep=3,
                          transports=("http", "nixl"))
    state = full_state(5)
    with serve_in_thread(create_app(config)) as server:
        for version, remote in enumerate(("nixl", "http"), start=1):
            with ParamsClient(server.url, remote_push=remote) as client:
                assert client.push(version, state)["via"] == remote
                pulled = client.pull(version, "http")
                assert all(pulled[n].tobytes() == a.tobytes() for n, a in state.items())


def join_over_nixl(client: ParamsClient, version: int, data: np.ndarray) -> PushSession:
    """Part 0 of 1 of a one-tensor version joins over NIXL (the first half of ``push_part``)."""
    begin = client.json(ParamsRoutes.join_part, version, 0, tensors=[{"name": "w", "dtype": "U8", "shape": [data.size]}],
                        parts=1, via="nixl")
    assert {"agent_name", "agent_metadata_b64", "base_address", "data_offset"} <= set(begin["details"])
    return PushSession(begin["push_id"], version, tuple(ChunkSpec.from_json(c) for c in begin["chunks"]),
                       checksum_algorithms()[0], part=0, details=begin["details"])


def finish(client: ParamsClient, session: PushSession, checksums: dict[int, str]) -> dict:
    return client.json(ParamsRoutes.finish_part, session.version, 0, push_id=session.push_id, checksums=checksums)


def test_bytes_that_differ_from_the_pushers_checksums_are_refused(tmp_path: Path) -> None:
    data = np.random.default_rng(5).integers(0, 256, 5 * CHUNK + 123, dtype=np.uint8)
    with params_server(tmp_path) as (url, store), ParamsClient(url) as client:
        client.push(1, {"w": np.zeros_like(data)})
        nixl = client.transport("nixl")
        session = join_over_nixl(client, 2, data)
        assert registered_pushes(store) == 1
        checksums = nixl.push(session, ByteRegions.flat(data))
        assert sorted(checksums) == list(range(6))

        # the trainer changes a byte after it was hashed: the slot then holds other bytes than claimed
        data[3 * CHUNK + 7] ^= 0xFF
        nixl.push(session, ByteRegions.flat(data))
        with pytest.raises(ServiceError) as torn:
            finish(client, session, checksums)
        assert torn.value.status == 422 and torn.value.code is ErrorCode.CHECKSUM_MISMATCH
        assert "chunk 3" in torn.value.detail
        with pytest.raises(ServiceError) as wrong:  # a checksum that matches nothing
            finish(client, session, {**checksums, 0: "xxh3_64:0000000000000000"})
        assert wrong.value.code is ErrorCode.CHECKSUM_MISMATCH
        assert client.latest().version == 1  # nothing of version 2 is visible
        with pytest.raises(ServiceError) as pending:
            client.pull(2)
        assert pending.value.status == 409 and "being pushed" in pending.value.detail

        # the pusher writes its bytes again and hands in their checksums: now the part is done
        fixed = nixl.push(session, ByteRegions.flat(data))
        assert fixed[3] != checksums[3] and finish(client, session, fixed)["visible"]
        assert client.pull(2, "nixl")["w"].tobytes() == data.tobytes()
        assert registered_pushes(store) == 0

        # an abandoned push over NIXL lets its registration go, and so does a PS that stops
        session = join_over_nixl(client, 3, data)
        client.abort_push(3, session.push_id)
        assert registered_pushes(store) == 0
        assert client.push(3, {"w": data})["via"] == "shm"  # 'auto' never picks nixl
        join_over_nixl(client, 4, data)
        assert registered_pushes(store) == 1
    assert registered_pushes(store) == 0


PARTIAL_NIXL_PUSHER = """
import sys
import numpy as np
from staleflow.api.params import ParamsRoutes
from staleflow.transports.base import PushSession
from staleflow.transports.checksums import checksum_algorithms
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions
from staleflow.transports.client import ParamsClient
url, total = sys.argv[1], int(sys.argv[2])
data = np.full(total, 0xAB, np.uint8)
with ParamsClient(url) as client:
    begin = client.json(ParamsRoutes.join_part, 2, 1, tensors=[{"name": "w", "dtype": "U8", "shape": [total]}], parts=2,
                        ranges=[[total // 2, total - total // 2]], via="nixl")
    chunks = tuple(ChunkSpec.from_json(c) for c in begin["chunks"])
    half = PushSession(begin["push_id"], 2, chunks[: len(chunks) // 2], checksum_algorithms()[0], part=1, details=begin["details"])
    client.transport("nixl").push(half, ByteRegions([(total // 2, memoryview(data[total // 2:]))], total))
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_pusher_killed_mid_push_over_nixl_leaves_no_visible_version(ps: tuple[str, ParamStore]) -> None:
    url, store = ps
    total = 16 * CHUNK
    data = np.arange(total, dtype=np.uint64).astype(np.uint8)
    tensors = {"w": ("U8", (total,))}
    with ParamsClient(url) as client:
        client.push(1, {"w": np.zeros(total, np.uint8)})
        rank1 = subprocess.Popen([sys.executable, "-c", PARTIAL_NIXL_PUSHER, url, str(total)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert rank1.stdout.readline().strip() == "ready"  # half of its chunks are in the slot
            reply = client.push_part(2, 0, 2, tensors, [ShardPiece("w", 0, data[: total // 2])], transport="nixl")
            assert not reply["visible"] and reply["parts_done"] == [0]
            rank1.send_signal(signal.SIGKILL)
            rank1.wait()
        finally:
            rank1.kill()
            rank1.wait()
        assert client.latest().version == 1  # the half-written version never shows
        with pytest.raises(ServiceError) as pending:
            client.pull(2)
        assert pending.value.status == 409 and "being pushed" in pending.value.detail
        assert registered_pushes(store) == 1

        # the restarted rank joins again (its part starts over) and pushes its share whole
        reply = client.push_part(2, 1, 2, tensors, [ShardPiece("w", total // 2, data[total // 2:])], transport="nixl")
        assert reply["visible"]
        assert client.pull("latest", "shm")["w"].tobytes() == data.tobytes()
        assert registered_pushes(store) == 0
