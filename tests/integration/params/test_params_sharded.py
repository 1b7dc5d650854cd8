"""Pushes in parts (one per trainer rank): the version becomes visible only when every part is
in and the parts tile it; a pusher killed mid-push never leaves a partial version visible."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from staleflow.api.base import ServiceError
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.errors import ChecksumMismatch

CHUNK = 64 << 10


def full_state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((301, 128)).astype(np.float32),  # rows do not split evenly
        "layers.0.norm": rng.standard_normal(7).astype(np.float16),  # fewer rows than some parts get
        "layers.0.proj": rng.integers(0, 2**31, (64, 33), dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


def table(state: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
    return {name: (names[a.dtype], a.shape) for name, a in state.items()}


def dim0_share(state: dict[str, np.ndarray], part: int, parts: int) -> list[ShardPiece]:
    """What FSDP's rank ``part`` holds: rows [part*ceil(n/parts), ...) of every tensor."""
    pieces = []
    for name, array in state.items():
        rows = -(-array.shape[0] // parts) if array.shape[0] else 0
        local = array[part * rows:(part + 1) * rows]
        if local.size:
            pieces.append(ShardPiece(name, part * rows * (array.nbytes // max(array.shape[0], 1)), np.ascontiguousarray(local)))
    return pieces


def config(tmp_path: Path, **overrides: object) -> ParamsConfig:
    return ParamsConfig(**{"state_dir": tmp_path, "port": 0, "chunk_bytes": CHUNK, "fsync": False, **overrides})


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with serve_in_thread(create_app(config(tmp_path, keep=3, push_ttl_s=2.0))) as server:
        yield server.url


def assert_equal(pulled: dict, state: dict[str, np.ndarray]) -> None:
    assert set(pulled) == set(state)
    for name, array in state.items():
        assert pulled[name].shape == array.shape and pulled[name].tobytes() == array.tobytes(), name


def test_parts_pushed_at_once_assemble_one_version(url: str) -> None:
    state, parts = full_state(1), 3
    replies: dict[int, dict] = {}

    def rank(part: int) -> None:
        with ParamsClient(url) as client:  # one client per pusher; part 1 sends over HTTP, the others over shm
            replies[part] = client.push_part(5, part, parts, table(state), dim0_share(state, part, parts),
                                             transport="http" if part == 1 else "shm", wait_s=60)

    threads = [threading.Thread(target=rank, args=(p,)) for p in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["visible"] for r in replies.values())
    with ParamsClient(url) as client:
        manifest = client.manifest(5)
        position = 0
        for chunk in manifest.chunks:  # the parts' chunks tile the data section
            assert chunk.offset == position and chunk.length <= CHUNK and chunk.checksum
            position += chunk.length
        assert position == manifest.total_bytes
        for transport in ("shm", "http"):
            assert_equal(client.pull(5, transport), state)
        out = {name: np.empty_like(a) for name, a in state.items()}
        client.pull(5, "shm", out=out)
        assert_equal(out, state)


def test_a_version_is_invisible_until_its_last_part_and_refuses_overlaps_and_gaps(url: str) -> None:
    state = full_state(2)
    with ParamsClient(url) as client:
        first = client.push_part(1, 0, 2, table(state), dim0_share(state, 0, 2))
        assert not first["visible"] and first["parts_done"] == [0]
        with pytest.raises(ServiceError) as not_yet:
            client.pull("latest")
        assert not_yet.value.status == 404
        with pytest.raises(ServiceError) as overlap:
            client.push_part(1, 1, 2, table(state), dim0_share(state, 0, 2))  # part 0's rows again
        assert overlap.value.status == 409 and "overlap" in overlap.value.detail
        half = dim0_share(state, 1, 2)[:1]  # part 1 forgets most of its tensors
        with pytest.raises(ServiceError) as gap:
            client.push_part(1, 1, 2, table(state), half)
        assert gap.value.status == 409 and "uncovered" in gap.value.detail
        assert client.push_part(1, 1, 2, table(state), dim0_share(state, 1, 2))["visible"]  # joining again starts over
        assert_equal(client.pull(1, "shm"), state)


PARTIAL_PUSHER = """
import sys, numpy as np
from staleflow.api.params import ParamsRoutes
from staleflow.transports.client import ParamsClient
url, total = sys.argv[1], int(sys.argv[2])
with ParamsClient(url) as client:
    begin = client.json(ParamsRoutes.join_part, 2, 1, tensors=[{"name": "w", "dtype": "U8", "shape": [total]}], parts=2,
                        ranges=[[total // 2, total - total // 2]], via="shm")
    with open(begin["details"]["path"], "r+b") as slot:  # half of its bytes, straight into the PS's memory
        slot.seek(begin["data_offset"] + total // 2)
        slot.write(b"x" * (total // 4))
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_pusher_killed_mid_push_leaves_no_visible_version(url: str) -> None:
    total = 1 << 20
    data = np.arange(total, dtype=np.uint64).astype(np.uint8)
    tensors = {"w": ("U8", (total,))}
    with ParamsClient(url) as client:
        client.push(1, {"w": np.zeros(total, np.uint8)})
        rank1 = subprocess.Popen([sys.executable, "-c", PARTIAL_PUSHER, url, str(total)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert rank1.stdout.readline().strip() == "ready"
            reply = client.push_part(2, 0, 2, tensors, [ShardPiece("w", 0, data[: total // 2])])
            assert not reply["visible"]
            rank1.send_signal(signal.SIGKILL)
            rank1.wait()
        finally:
            rank1.kill()
        assert client.latest().version == 1  # the half-written version never shows
        with pytest.raises(ServiceError) as pending:
            client.pull(2)
        assert pending.value.status == 409 and "being pushed" in pending.value.detail
        deadline = time.monotonic() + 60
        while client.versions().pushes:  # the idle push expires (push_ttl_s) and its memory goes
            assert time.monotonic() < deadline, client.versions().pushes
            time.sleep(0.1)  # poll pacing, the PS's sweep decides
        for part, piece in ((0, data[: total // 2]), (1, data[total // 2:])):  # the restarted ranks push again
            reply = client.push_part(2, part, 2, tensors, [ShardPiece("w", part * (total // 2), piece)])
        assert reply["visible"]
        assert client.pull("latest", "shm")["w"].tobytes() == data.tobytes()


def test_a_corrupted_slot_fails_verification(url: str) -> None:
    state = full_state(3)
    with ParamsClient(url) as client:
        client.push(1, state)
        lease = client.open_pull(1, "shm")
        client.close_pull(lease)
        with open(lease.details["path"], "r+b") as slot:
            slot.seek(lease.manifest.data_offset + 100)
            slot.write(b"\xff\xfe")
        for transport in ("shm", "http"):  # both read the same memory; a puller that hashes finds it
            with pytest.raises(ChecksumMismatch):
                client.pull(1, transport, verify="checksum")
        with pytest.raises(ChecksumMismatch):
            client.pull(1, "http")  # http hashes by default


def test_the_trainer_pushes_again_a_version_the_ps_lost_before_persisting_it(tmp_path: Path) -> None:
    """Memory first: a version visible but not yet on disk dies with the PS; the trainer role,
    still holding its tensors, pushes it again before the next one."""
    from staleflow.training.role import StepLog, TrainerLoop
    from staleflow.training.simulated import SimulatedBackend

    backend = SimulatedBackend(0.0, 0.0, 1000, 1.0, threading.Event())
    with serve_in_thread(create_app(config(tmp_path / "a", persist=False))) as first, ParamsClient(first.url) as client:
        loop = TrainerLoop(backend, steps=3, eta=1, urls={"params": first.url}, step_log=StepLog(tmp_path / "steps"),
                           stop=threading.Event())
        loop.params = client
        loop._push(1, backend.weights(1))
        assert client.latest().version == 1
    # the PS stopped with version 1 in memory only (never persisted): its successor finds nothing
    with serve_in_thread(create_app(config(tmp_path / "a"))) as second, ParamsClient(second.url) as client:
        loop.params = client
        loop._push(2, backend.weights(2))
        assert [v.version for v in client.versions().versions] == [1, 2]
        assert client.pull(1)["weights"].tobytes() == np.full(1000, 1, np.uint8).tobytes()


def test_part_chunks_are_bounded_by_the_chunk_size_not_the_body_limit(tmp_path: Path) -> None:
    state = full_state(4)
    app = create_app(config(tmp_path, chunk_bytes=256 << 10))
    with serve_in_thread(app, body_limit=128 << 10) as server, ParamsClient(server.url) as client:
        assert client.push_part(1, 0, 1, table(state), dim0_share(state, 0, 1), transport="http")["visible"]
        assert_equal(client.pull(1, "http"), state)
