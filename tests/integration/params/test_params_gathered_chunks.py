"""A MoE table pushed by several FSDP ranks: each rank's thousands of small shards travel in a few
gathered chunks (one request, one copy task each), and the version's manifest is cut anew over
the data section, so it has about ``bytes / chunk_bytes`` chunks whatever the tensor count. The
chunks that join several ranks' bytes are hashed by the PS before the version is visible: a
corrupted byte in one is caught by every verifying pull, a torn or abandoned part never makes
the version visible, and a version recovered from disk is checked against those checksums."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_params_real_tables import TINY_MOE, random_weights, rank_share

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes
from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.checksums import checksum_of
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.errors import ChecksumMismatch
from staleflow.transports.http import CHECKSUM_HEADER, RawHttpConnection
from staleflow.transports.layout import ChunkSpec, laid_table, layout_tensors
from staleflow.transports.tables import fsdp_shard_ranges, model_tensor_table, table_bytes

CHUNK = 256 << 10  # the tiny MoE table is ~2.4 MB: several chunks, each joining many tensors of every rank


def config(state_dir: Path, **overrides: object) -> ParamsConfig:
    return ParamsConfig(**{"state_dir": state_dir, "port": 0, "chunk_bytes": CHUNK, "fsync": False, "keep": 2,
                           "push_ttl_s": 30.0, **overrides})


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with serve_in_thread(create_app(config(tmp_path))) as server:
        yield server.url


@pytest.fixture(scope="module")
def moe() -> tuple[dict, dict[str, torch.Tensor]]:
    table = model_tensor_table(TINY_MOE)
    return table, random_weights(table, seed=11)


def data_offsets(table: dict) -> dict[str, int]:
    return {t.name: t.offset for t in layout_tensors([(n, d, list(s)) for n, (d, s) in table.items()])}


def push_ranks(url: str, version: int, table: dict, weights: dict, transports: list[str]) -> list[dict]:
    """Every rank pushes its FSDP share at once, rank ``r`` over ``transports[r]``."""
    replies: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            with ParamsClient(url) as client:
                replies[rank] = client.push_part(version, rank, len(transports), table,
                                                 rank_share(weights, table, rank, len(transports)),
                                                 transport=transports[rank], wait_s=30)
        except BaseException as exc:  # reported below, on the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(transports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return [replies[rank] for rank in range(len(transports))]


def assert_pulls_back(client: ParamsClient, version: int, weights: dict[str, torch.Tensor]) -> None:
    """Whole and selected pulls over shm and http, every byte hashed (joined chunks included)."""
    some = list(weights)[5::300]
    for transport in ("shm", "http"):
        pulled = client.pull(version, transport, as_torch=True, verify="checksum")
        assert list(pulled) == list(weights)
        assert all(torch.equal(pulled[name], weights[name]) for name in weights), transport
        selected = client.pull(version, transport, as_torch=True, verify="checksum", select=some)
        assert sorted(selected) == sorted(some) and all(torch.equal(selected[n], weights[n]) for n in some), transport


@pytest.mark.parametrize("transports", [["shm", "shm"], ["shm", "shm", "shm", "shm"], ["http", "http", "http"],
                                        ["shm", "http"]])
def test_a_moe_table_pushed_in_parts_has_about_one_chunk_per_chunk_bytes(url: str, moe: tuple, transports: list[str]) -> None:
    table, weights = moe
    total = table_bytes(table)
    assert len(table) > 1500 and all(n < CHUNK for _, _, n in fsdp_shard_ranges(table, 0, 2))  # small shards only
    replies = push_ranks(url, 1, table, weights, transports)
    assert any(r["visible"] for r in replies) and all(r["via"] == t for r, t in zip(replies, transports, strict=True))
    with ParamsClient(url) as client:
        manifest = client.manifest(1)
        assert len(manifest.chunks) <= math.ceil(total / CHUNK) + len(transports)  # not one per tensor and rank
        position = 0
        for chunk in manifest.chunks:  # contiguous chunks tiling the data section, each with a checksum
            assert chunk.offset == position and 0 < chunk.length <= CHUNK and chunk.checksum and not chunk.ranges
            position += chunk.length
        assert position == total
        joined = [c for c in manifest.chunks if c.segments]  # made of the ranks' checksums: no byte hashed twice
        assert joined and all(len(c.segments) > 1 and sum(c.segments) == c.length for c in joined)
        assert_pulls_back(client, 1, weights)


def test_gathered_chunks_handed_in_without_checksums_are_hashed_by_the_ps(url: str, moe: tuple) -> None:
    """A part written over shm whose pusher hands in no checksums for its gathered chunks: the
    PS hashes the chunks holding those bytes itself before the version is visible."""
    table, weights = moe
    tensors = [{"name": n, "dtype": d, "shape": list(s)} for n, (d, s) in table.items()]
    offsets = data_offsets(table)
    share = rank_share(weights, table, 1, 2)
    with ParamsClient(url) as client:
        assert not client.push_part(1, 0, 2, table, rank_share(weights, table, 0, 2), transport="shm")["visible"]
        joined = client.json(ParamsRoutes.join_part, 1, 1, tensors=tensors, parts=2, via="shm", gather=True,
                             ranges=[[offsets[p.name] + p.start, p.data.numel()] for p in share])
        assert all(c["ranges"] for c in joined["chunks"])
        with open(joined["details"]["path"], "r+b") as slot:
            for piece in share:
                slot.seek(joined["data_offset"] + offsets[piece.name] + piece.start)
                slot.write(piece.data.numpy().tobytes())
        done = client.finish_part(1, 1, joined["push_id"], checksums={})
        assert done["visible"]
        manifest = client.manifest(1)
        assert all(c.checksum and not c.segments for c in manifest.chunks)  # the PS's own hashes of whole chunks
        assert len(manifest.chunks) <= math.ceil(table_bytes(table) / CHUNK) + 2
        assert_pulls_back(client, 1, weights)


def test_a_rank_pushes_its_small_shards_in_a_few_gathered_chunks(url: str, moe: tuple) -> None:
    table, _ = moe
    tensors = [{"name": n, "dtype": d, "shape": list(s)} for n, (d, s) in table.items()]
    offsets = data_offsets(table)
    share = [[offsets[name] + start, n] for name, start, n in fsdp_shard_ranges(table, 1, 2)]
    with ParamsClient(url) as client:
        joined = client.json(ParamsRoutes.join_part, 1, 1, tensors=tensors, parts=2, ranges=share, via="http", gather=True)
        old_style = client.json(ParamsRoutes.join_part, 1, 1, tensors=tensors, parts=2, ranges=share, via="http")
    share_bytes = sum(n for _, n in share)
    assert len(joined["chunks"]) <= 2 * math.ceil(share_bytes / CHUNK) + 1
    assert len(old_style["chunks"]) == len(share)  # a pusher that does not gather gets one chunk per range, as before
    spans = [tuple(span) for chunk in joined["chunks"] for span in chunk["ranges"] or [(chunk["offset"], chunk["length"])]]
    assert sorted(spans) == sorted(tuple(r) for r in share)


def test_a_corrupted_byte_in_a_joined_chunk_fails_every_verifying_pull(url: str, moe: tuple) -> None:
    table, weights = moe
    push_ranks(url, 1, table, weights, ["shm", "shm"])
    with ParamsClient(url) as client:
        lease = client.open_pull(1, "shm")
        client.close_pull(lease)
        chunk = lease.manifest.chunks[1]
        with open(lease.details["path"], "r+b") as slot:  # one byte in the middle of a chunk of both ranks' bytes
            slot.seek(lease.manifest.data_offset + chunk.offset + chunk.length // 2)
            byte = slot.read(1)
            slot.seek(-1, 1)
            slot.write(bytes([byte[0] ^ 0x40]))
        for transport in ("shm", "http"):
            with pytest.raises(ChecksumMismatch) as caught:
                client.pull(1, transport, verify="checksum")
            assert caught.value.chunk_index == chunk.index
        with pytest.raises(ChecksumMismatch):
            client.pull(1, "http")  # http hashes by default


def test_a_torn_or_abandoned_part_never_makes_the_version_visible(url: str, moe: tuple) -> None:
    table, weights = moe
    tensors = [{"name": n, "dtype": d, "shape": list(s)} for n, (d, s) in table.items()]
    with ParamsClient(url) as client:
        client.push(1, weights)
        first = client.push_part(2, 0, 2, table, rank_share(weights, table, 0, 2), transport="shm")
        assert not first["visible"]
        share = rank_share(weights, table, 1, 2)
        offsets = data_offsets(table)
        joined = client.json(ParamsRoutes.join_part, 2, 1, tensors=tensors, parts=2, via="http", gather=True,
                             ranges=[[offsets[p.name] + p.start, p.data.numel()] for p in share])
        gathered = next(ChunkSpec.from_json(c) for c in joined["chunks"] if c["ranges"])
        by_offset = {offsets[p.name] + p.start: p for p in share}
        body = b"".join(by_offset[o].data.numpy().tobytes() for o, _ in gathered.ranges)
        assert len(body) == gathered.length
        target = ParamsRoutes.put_part_chunk.target(2, 1, gathered.index, push_id=joined["push_id"])
        data_url = url.rsplit(":", 1)[0] + f":{client.health().data_port}"
        with RawHttpConnection(data_url) as conn:  # a torn body: its checksum is not the bytes'
            torn = bytearray(body)
            torn[len(torn) // 2] ^= 1
            status, _, reply = conn.request("PUT", target, {CHECKSUM_HEADER: checksum_of("crc32", [body])}, [memoryview(torn)])
            assert status == 422 and b"checksum" in reply
        with RawHttpConnection(data_url) as conn:  # an abandoned body: the pusher dies half way
            conn.send("PUT", target, {CHECKSUM_HEADER: checksum_of("crc32", [body]), "Content-Length": str(len(body))})
            conn._connection().sock.sendall(body[:len(body) // 2])
        with pytest.raises(ServiceError) as incomplete:
            client.json(ParamsRoutes.finish_part, 2, 1, push_id=joined["push_id"])
        assert incomplete.value.status == 409 and "incomplete" in incomplete.value.detail
        assert client.latest().version == 1  # nothing torn is visible
        with pytest.raises(ServiceError) as pending:
            client.pull(2)
        assert pending.value.status == 409 and "being pushed" in pending.value.detail
        deadline = time.monotonic() + 30
        while any(p.writing for p in client.versions().pushes):  # the PS notices the dead connection
            assert time.monotonic() < deadline
            time.sleep(0.05)  # poll pacing; the data plane's thread decides
        assert client.push_part(2, 1, 2, table, share, transport="http", wait_s=10)["visible"]  # the rank pushes again
        assert_pulls_back(client, 2, weights)


def test_gathered_chunks_through_the_api_port_and_a_version_recovered_from_disk(tmp_path: Path, moe: tuple) -> None:
    """Without a data plane the REST app receives the gathered bodies; the checksums the PS
    computed at commit are what a restarted PS checks the persisted version against."""
    table, weights = moe
    with serve_in_thread(create_app(config(tmp_path, data_port=None))) as server:
        push_ranks(server.url, 1, table, weights, ["http", "http"])
        with ParamsClient(server.url) as client:
            assert client.health().data_port is None
            assert client.wait_persisted(1, 60)
            assert_pulls_back(client, 1, weights)
    with serve_in_thread(create_app(config(tmp_path))) as server, ParamsClient(server.url) as client:
        assert [v.version for v in client.versions().versions] == [1]
        assert_pulls_back(client, 1, weights)  # loaded into a memory slot, every chunk checked as it lands


def test_a_pusher_names_a_table_it_sent_before_by_its_digest(tmp_path: Path, moe: tuple) -> None:
    """The tensor table (thousands of entries) is sent with a rank's first push; later joins send
    its digest. A PS that does not know the digest (restarted) answers unknown_table and the
    client sends the table again; a digest that is not the tensors' is refused."""
    table, weights = moe
    tensors = [{"name": n, "dtype": d, "shape": list(s)} for n, (d, s) in table.items()]
    digest = laid_table([(n, d, list(s)) for n, (d, s) in table.items()])[1]
    whole = [[0, table_bytes(table)]]
    with serve_in_thread(create_app(config(tmp_path / "a"))) as server, ParamsClient(server.url) as client:
        with pytest.raises(ServiceError) as unknown:  # never sent here
            client.json(ParamsRoutes.join_part, 1, 0, table=digest, parts=1, ranges=whole, via="http")
        assert unknown.value.status == 404 and unknown.value.code is ErrorCode.UNKNOWN_TABLE
        assert client.push_part(1, 0, 1, table, rank_share(weights, table, 0, 1), transport="shm")["visible"]
        named = client.json(ParamsRoutes.join_part, 2, 0, table=digest, parts=1, ranges=whole, via="http")
        assert named["table"] == digest and named["total_bytes"] == table_bytes(table)
        client.abort_push(2, named["push_id"])
        assert client.push_part(2, 0, 1, table, rank_share(weights, table, 0, 1), transport="shm")["visible"]
        with pytest.raises(ServiceError) as mismatch:
            client.json(ParamsRoutes.join_part, 3, 0, tensors=tensors, table="f" * 32, parts=1, ranges=whole, via="http")
        assert mismatch.value.status == 422 and "digest" in mismatch.value.detail
        with pytest.raises(ServiceError) as neither:
            client.json(ParamsRoutes.join_part, 3, 0, parts=1, ranges=whole, via="http")
        assert neither.value.status == 422
        remembered = set(client._tables_sent)
    assert remembered == {digest}
    with serve_in_thread(create_app(config(tmp_path / "b"))) as server, ParamsClient(server.url) as client:
        client._tables_sent = remembered  # a trainer's client across a restart of its PS
        assert client.push_part(3, 0, 1, table, rank_share(weights, table, 0, 1), transport="http")["visible"]
        assert_pulls_back(client, 3, weights)


def test_a_table_changed_in_place_between_pushes_is_laid_out_anew(url: str) -> None:
    """The client keeps the last table it laid out; a mapping changed since (in place or not) is
    never taken for it."""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {"a": ("U8", (4, 4)), "b": ("U8", (8,))}
    with ParamsClient(url) as client:
        data = {"a": np.arange(16, dtype=np.uint8), "b": np.full(8, 7, np.uint8)}
        assert client.push_part(1, 0, 1, tensors, [ShardPiece(n, 0, d) for n, d in data.items()])["visible"]
        tensors["a"] = ("U8", (2, 4))  # the same mapping, another table
        data["a"] = np.arange(8, dtype=np.uint8)
        assert client.push_part(2, 0, 1, tensors, [ShardPiece(n, 0, d) for n, d in data.items()])["visible"]
        pulled = client.pull(2)
        assert pulled["a"].shape == (2, 4) and pulled["a"].tobytes() == bytes(range(8))
        assert pulled["b"].tobytes() == b"\x07" * 8


@pytest.mark.parametrize("transport", ["shm", "http"])
@pytest.mark.parametrize("with_copied_piece", [False, True])
def test_pieces_pushed_again_carry_the_bytes_they_hold_now(url: str, transport: str, with_copied_piece: bool) -> None:
    """A pusher that hands the same pieces every version gets its first push's views and copy
    windows back: every later push still carries (and checksums) the bytes the buffers hold at
    that push, and a piece that was copied on the way (a non-contiguous array) or replaced is
    viewed anew."""
    tensors = {f"t{i}": ("U8", (3000 + i,)) for i in range(40)} | {"m": ("U8", (6, 4))}
    buffers = {n: np.zeros(s[0], np.uint8) for n, (_, s) in tensors.items() if n != "m"}
    matrix = np.zeros((4, 6), np.uint8).T if with_copied_piece else np.zeros((6, 4), np.uint8)
    pieces = [ShardPiece(n, 0, b) for n, b in buffers.items()] + [ShardPiece("m", 0, matrix)]
    with ParamsClient(url) as client:
        for version in (1, 2, 3):
            for i, buffer in enumerate(buffers.values()):
                buffer[:] = (version * 31 + i) % 251
            matrix[:] = np.arange(24, dtype=np.uint8).reshape(6, 4) + version
            if version == 3:
                buffers["t5"] = np.full(3005, 200, np.uint8)
                pieces[5] = ShardPiece("t5", 0, buffers["t5"])
            assert client.push_part(version, 0, 1, tensors, pieces, transport=transport)["visible"]
            assert (client._last_source is None) == with_copied_piece  # kept for the next push unless copied
            pulled = client.pull(version, "http", verify="checksum")
            for name, buffer in buffers.items():
                assert np.array_equal(pulled[name], buffer), (version, name)
            assert np.array_equal(pulled["m"], matrix), version


def test_pulls_into_the_same_buffers_land_each_version_and_a_replaced_buffer_is_used(url: str) -> None:
    """An instance pulling every version into the same arrays gets the first pull's views back;
    each pull still lands its version's bytes, and a buffer replaced in ``out`` receives them."""
    tensors = {f"t{i}": ("U8", (2000 + i,)) for i in range(30)}
    out = {n: np.zeros(s[0], np.uint8) for n, (_, s) in tensors.items()}
    with ParamsClient(url) as client:
        for version in (1, 2, 3):
            data = {n: np.full(s[0], (version * 17 + i) % 251, np.uint8) for i, (n, (_, s)) in enumerate(tensors.items())}
            assert client.push_part(version, 0, 1, tensors, [ShardPiece(n, 0, d) for n, d in data.items()],
                                    transport="shm")["visible"]
            if version == 3:
                out["t4"] = np.zeros(2004, np.uint8)
            for transport in ("shm", "http"):
                pulled = client.pull(version, transport, out=out, verify="checksum")
                for name in tensors:
                    assert pulled[name] is out[name] and np.array_equal(out[name], data[name]), (version, transport, name)
