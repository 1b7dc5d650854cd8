"""The shm pull's guard against a slot reused under a reader: the generation stamp (seqlock) the
PS sets before it writes another version into a slot, checked by the puller before and after each
copied batch. A pull either hands out the version it leased, byte for byte, or fails with
``SlotReused``; nothing torn is ever yielded. Real shared-memory segments, real copy threads, a
real parameter server on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.api.base import ServiceError
from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.base import PullLease
from staleflow.transports.checksums import checksum_algorithms, checksum_of, verify_mode
from staleflow.transports.client import ParamsClient
from staleflow.transports.errors import ChecksumMismatch, FormatError, SlotReused
from staleflow.transports.layout import ChunkSpec, Manifest, layout_tensors, plan_chunks
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import ShmSlots, ShmTransport, host_id

HEADER = 64  # where the data section starts in the test's slots


def put_version(slots: ShmSlots, version: int, payload: np.ndarray, chunk_bytes: int) -> PullLease:
    """What the PS does for a push and a lease: reserve a slot, write the bytes, hand out a lease
    naming the slot's generation."""
    slot = slots.reserve(version, HEADER + len(payload))
    assert slot.mapping is not None
    slot.mapping[HEADER:HEADER + len(payload)] = payload.tobytes()
    slot.visible = True
    algorithm = checksum_algorithms()[0]
    chunks = tuple(ChunkSpec(c.index, c.offset, c.length, checksum_of(algorithm, [payload[c.offset:c.offset + c.length]]))
                   for c in plan_chunks(len(payload), chunk_bytes))
    manifest = Manifest(version, tuple(layout_tensors([("w", "U8", [len(payload)])])), chunks, chunk_bytes, HEADER)
    details = {"path": str(slot.path), "size": slot.size, "host_id": host_id(), "stamp_path": str(slot.stamp_path),
               "generation": slot.generation}
    return PullLease(f"lease-{version}", manifest, "shm", details)


@pytest.fixture
def slots(tmp_path: Path) -> Iterator[ShmSlots]:
    memory = ShmSlots(tmp_path, "guard")
    yield memory
    memory.close()


@pytest.fixture
def transport() -> Iterator[ShmTransport]:
    mover = ShmTransport(workers=2)
    yield mover
    mover.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 20 << 20), chunk_kib=st.sampled_from([64, 1024, 4096]), reuse_after=st.integers(0, 6),
       next_size=st.sampled_from(["same", "smaller", "larger"]))
def test_a_reused_slot_fails_the_pull_after_the_last_intact_prefix(slots: ShmSlots, transport: ShmTransport, size: int,
                                                                 chunk_kib: int, reuse_after: int, next_size: str) -> None:
    """The slot takes version 2 after the reader consumed ``reuse_after`` verified prefixes (0: before
    the pull starts; the copy threads take 4 MiB batches, so up to 5 prefixes here): every prefix
    handed out before holds version 1's bytes, and none is handed out after: the pull fails with
    SlotReused, or ends (the reuse came after its last prefix) with version 1 whole."""
    rng = np.random.default_rng(size)
    first = rng.integers(0, 256, size, np.uint8)
    lease = put_version(slots, 1, first, chunk_kib << 10)
    into = np.zeros(size, np.uint8)
    reused = False

    def reuse() -> None:
        nonlocal reused
        slots.release(1)
        second_size = {"same": size, "smaller": max(1, size // 2), "larger": size + 4096}[next_size]
        put_version(slots, 2, rng.integers(0, 256, second_size, np.uint8), chunk_kib << 10)
        assert slots.slot_of(2).path == Path(lease.details["path"])  # the very slot being read
        reused = True

    taken = 0
    try:
        if reuse_after == 0:
            reuse()
        for end in transport.pull_verified(lease, ByteRegions.flat(into), "auto"):
            assert not reused, "a prefix was handed out after the slot was reused"
            assert np.array_equal(into[:end], first[:end])
            taken += 1
            if taken == reuse_after:
                reuse()
    except SlotReused as exc:
        assert reused and exc.code is ErrorCode.SLOT_REUSED and exc.version == 1
    else:
        assert np.array_equal(into, first)
    finally:
        slots.release(1)
        slots.release(2)


def test_a_slot_rewritten_while_copy_threads_read_it_never_yields_torn_bytes(slots: ShmSlots,
                                                                             transport: ShmTransport) -> None:
    """A writer thread reuses the slot for version 2 and writes it while the reader's copy threads
    copy version 1 out: each round the reader gets version 1 whole, or SlotReused with every
    prefix it was handed intact; a byte of version 2 is never handed out."""
    size, chunk = 8 << 20, 256 << 10
    first, second = np.full(size, 1, np.uint8), np.full(size, 2, np.uint8)
    outcomes = {"whole": 0, "reused": 0}
    for _ in range(12):
        lease = put_version(slots, 1, first, chunk)
        into = np.zeros(size, np.uint8)
        started = threading.Event()

        def rewrite(started: threading.Event = started) -> None:
            started.wait()
            slots.release(1)
            put_version(slots, 2, second, chunk)

        writer = threading.Thread(target=rewrite)
        writer.start()
        handed_out = 0
        try:
            for end in transport.pull_verified(lease, ByteRegions.flat(into), "auto"):
                started.set()
                assert not np.any(into[handed_out:end] != 1), "a torn prefix was handed out"
                handed_out = end
            outcomes["whole"] += 1
            assert np.array_equal(into, first)
        except SlotReused:
            outcomes["reused"] += 1
        finally:
            started.set()
            writer.join()
            slots.release(1)
            slots.release(2)
    assert sum(outcomes.values()) == 12


def test_checksum_mode_hashes_every_byte_and_auto_falls_back_to_it_without_a_stamp(slots: ShmSlots,
                                                                                  transport: ShmTransport) -> None:
    payload = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    lease = put_version(slots, 1, payload, 64 << 10)
    slot = slots.slot_of(1)
    assert slot is not None and slot.mapping is not None
    slot.mapping[HEADER + 70_000] ^= 0xFF  # behind the PS's back: not a reuse, so the stamp cannot see it
    into = np.zeros(len(payload), np.uint8)
    list(transport.pull_verified(lease, ByteRegions.flat(into), "auto"))  # the stamp is intact
    with pytest.raises(ChecksumMismatch) as caught:
        list(transport.pull_verified(lease, ByteRegions.flat(into), "checksum"))
    assert caught.value.chunk_index == 1
    stampless = PullLease(lease.lease_id, lease.manifest, "shm",
                          {k: v for k, v in lease.details.items() if k not in ("stamp_path", "generation")})
    with pytest.raises(ChecksumMismatch):  # a PS that hands out no stamp: auto hashes instead
        list(transport.pull_verified(stampless, ByteRegions.flat(into), "auto"))


def test_bad_verify_values_are_refused_with_the_choices() -> None:
    assert [verify_mode(v) for v in ("auto", "checksum", "none", True, False)] == ["auto", "checksum", "none", "checksum", "none"]
    for bad in ("stamp", "yes", 1, None):
        with pytest.raises(FormatError, match="use 'auto'"):
            verify_mode(bad)  # type: ignore[arg-type]


def state_dict(seed: int) -> dict[str, np.ndarray]:
    """12 MiB: more than one batch of chunks for the copy threads (``BATCH_BYTES``)."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(12)}


def test_a_reader_whose_lease_lapsed_fails_when_the_ps_reuses_its_slot(tmp_path: Path) -> None:
    """Against a real PS: an shm reader stops mid-pull, its lease lapses, two newer versions land
    and the second takes the reader's slot. Going on, the reader fails with slot_reused; every
    tensor it was handed is version 1's. A new pull of the stale lease fails before copying."""
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=64 << 10, fsync=False, keep=1, lease_ttl_s=0.5,
                          transports=("http", "shm"))
    first = state_dict(1)
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        client.push(1, first)
        # the PS pins a version while it copies it to disk: once that is done, only the reader's
        # lease keeps version 1's slot, so version 3 lands in it exactly when the lease has lapsed
        assert client.wait_persisted(1, 60)
        lease = client.open_pull(1, "shm")
        reading = client.receive(lease)
        name, tensor = next(reading)
        assert np.array_equal(tensor, first[name])
        deadline = time.monotonic() + 30
        while client.versions().readers["leases"]:
            assert time.monotonic() < deadline, "the lease did not lapse"
            time.sleep(0.05)  # poll pacing; the PS's sweeper decides
        client.push(2, state_dict(2))  # into the spare slot; version 1 goes, its slot is free
        client.push(3, state_dict(3))  # into version 1's slot
        newest = client.open_pull(3, "shm")
        client.close_pull(newest)
        assert newest.details["path"] == lease.details["path"]
        with pytest.raises(SlotReused) as caught:
            for name, tensor in reading:
                assert np.array_equal(tensor, first[name]), f"{name}: torn"
        assert caught.value.code is ErrorCode.SLOT_REUSED and "--lease-ttl" in caught.value.message
        with pytest.raises(SlotReused):
            next(client.receive(lease))
        third = state_dict(3)
        assert all(np.array_equal(a, third[n]) for n, a in client.pull(3, "shm").items())


def test_a_version_loaded_from_disk_enters_its_slot_verified(tmp_path: Path) -> None:
    """shm pullers trust a slot's bytes by default, so a version recovered from disk is hashed as
    it is loaded into one: a damaged file is refused (422 checksum_mismatch) and leaves no slot."""
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=64 << 10, fsync=False, keep=2, transports=("http", "shm"))
    first, second = state_dict(1), state_dict(2)
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        client.push(1, first)
        client.push(2, second)
        assert client.wait_persisted(1, 60) and client.wait_persisted(2, 60)
        data_offset = client.manifest(1).data_offset
    stored = tmp_path / "versions" / "v0000000001" / "model.safetensors"
    with open(stored, "r+b") as file:  # one byte of chunk 3 rots on disk
        file.seek(data_offset + 3 * (64 << 10) + 5)
        byte = file.read(1)[0]
        file.seek(data_offset + 3 * (64 << 10) + 5)
        file.write(bytes([byte ^ 0xFF]))
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        with pytest.raises(ServiceError) as refused:
            client.open_pull(1, "shm")
        assert refused.value.status == 422 and refused.value.code is ErrorCode.CHECKSUM_MISMATCH
        assert "chunks [3]" in refused.value.detail
        with pytest.raises(ChecksumMismatch):
            client.pull(1, "http")  # served from the file, hashed by the puller
        assert client.versions().shm["slots"] <= 1 and client.versions().readers["leases"] == 0
        pulled = client.pull(2, "shm")  # an intact one loads and pulls
        assert all(np.array_equal(pulled[n], second[n]) for n in second)
