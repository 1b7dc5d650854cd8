"""The ``shm`` transport: instances on the PS's host read a version straight out of shared memory.

Server side, :class:`ShmSlots` keeps each retained version as a whole safetensors file in a
POSIX shared-memory segment (a file under ``/dev/shm``; ``shm_open`` / ``SharedMemory(name)``
open the same object). A pull lease hands out the segment path; the puller maps it and copies the
tensors out, so a pull is one memcpy.

Segments are *slots* that get reused: when a version is evicted and no one reads it, its slot
takes the next version, and keeps its size when the model's size did not change. A puller caches
its mapping of each slot, so the page tables stay populated across versions. Mapping a fresh
segment costs one page fault per 4 KiB page (here: 5 GB/s for a 1 GB copy instead of 17 GB/s
through a populated mapping). A slot is never rewritten while a lease on its version is open:
that is the read-write rule of the PS.

The puller checks the rule without hashing every byte: each slot has a *generation stamp* (an
8-byte word in a small segment of its own, ``<slot>.stamp``) that the PS sets to a new value
whenever the slot is reserved for another version, before any byte of it changes. A lease names
the generation it was granted under; the puller reads the stamp before copying and again after
each batch of chunks is copied (a seqlock whose writer side is the slot's reuse): a changed stamp
fails the pull before anything copied since is handed out. The chunk checksums, computed once as
the bytes entered the slot, are re-hashed by the puller only when it asks (``verify="checksum"``).

Memory: (keep + 1) x model size of shared memory, counted against ``/dev/shm``'s size.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from staleflow.transports.base import PullLease, PushSession, Transport
from staleflow.transports.checksums import ChunkHasher, SegmentHasher, checksum_bytes, chunk_hasher, verify_mode
from staleflow.transports.errors import ChecksumMismatch, SlotReused, TransportUnavailable
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions, address_of, pieces_of
from staleflow.transports.selection import ChunkStep, SelectionPlan, copy_blocks

T = TypeVar("T")

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # copy step: small enough that the verifier hashes it while it is in cache (measured best)
# The copy step where every byte's source and destination addresses agree modulo 64. glibc copies
# less than the L2 size (1 MiB on AMD EPYC) with ``rep movsb``: at memcpy's cost for mutually aligned
# buffers, at twice it otherwise; from 1 MiB on it runs a vector loop whose stores first read each
# destination line, 1.2-1.3x memcpy's cost whatever the alignment. Measured on this project's 2-core
# AMD EPYC machine (per GB of CPU time: whole memcpy 0.085 s; 512 KiB steps 0.084 s aligned, 0.17 s
# not; 1 MiB steps 0.10-0.11 s). Half of L2 also keeps both sides of a step in cache for the hash.
ALIGNED_PIECE_BYTES = 512 << 10
COPY_ALIGNMENT = 64
STAMP_BYTES = 64  # a slot's generation stamp: the first 8 bytes (native uint64) of a cache line of its own


def stamp_path_of(slot_path: Path | str) -> Path:
    """The segment holding the generation stamp of the slot at ``slot_path``."""
    path = Path(slot_path)
    return path.with_name(path.name + ".stamp")


def host_id() -> str:
    """Identifies this boot of this machine: shared memory is only shared under the same one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"{os.uname().nodename}"


@dataclass
class ShmSlot:
    path: Path
    size: int
    version: int | None = None
    fd: int | None = None  # the PS's read-write descriptor, open while the slot is in use
    mapping: mmap.mmap | None = None  # the PS's own read-write mapping, kept across versions
    visible: bool = False  # False while a push is filling it
    allocated: int = 0  # bytes of shared memory already allocated to it
    generation: int = 0  # set anew each time the slot is reserved for a version (see the module doc)
    stamp: mmap.mmap | None = None  # the PS's mapping of the generation stamp
    stamp_word: np.ndarray | None = None  # the stamp as one uint64

    @property
    def stamp_path(self) -> Path:
        return stamp_path_of(self.path)

    def set_generation(self, generation: int) -> None:
        """Publish a new generation in the stamp; one aligned 8-byte store, made before any byte of
        the slot is written for the new version."""
        if self.stamp is None:
            fd = os.open(self.stamp_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, STAMP_BYTES)
                self.stamp = mmap.mmap(fd, STAMP_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.stamp_word = np.frombuffer(self.stamp, np.uint64, 1)
        assert self.stamp_word is not None
        self.stamp_word[0] = generation
        self.generation = generation

    def close_stamp(self) -> None:
        self.stamp_word = None
        if self.stamp is not None:
            with contextlib.suppress(BufferError):
                self.stamp.close()
            self.stamp = None

    def view(self) -> memoryview:
        assert self.mapping is not None
        return memoryview(self.mapping)

    def unmap(self) -> None:
        if self.mapping is not None:
            with contextlib.suppress(BufferError):  # a view still exported: it unmaps when collected
                self.mapping.close()
            self.mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ShmSlots:
    """Server side: the PS's host-memory tier. Each version lives in one slot (a file under
    ``/dev/shm``): a push writes straight into a reserved slot (the pushers over their own
    mappings, or the PS for bytes received over HTTP), and the version becomes visible from it."""

    def __init__(self, directory: Path, prefix: str, spare: int = 1):
        self.directory = directory
        self.prefix = prefix
        self.spare = spare
        self._slots: list[ShmSlot] = []
        self._lock = threading.Lock()
        self._next_id = 0
        # generations start from the clock, so no two lifetimes of this PS hand out the same ones
        self._generation = time.time_ns()
        if not directory.is_dir():
            raise TransportUnavailable(f"shared-memory directory {directory} does not exist")
        self.remove_stale()

    def remove_stale(self) -> None:
        """Segments left by a previous process of this PS (same state directory): unlink them."""
        for path in self.directory.glob(f"{self.prefix}-slot*"):
            path.unlink(missing_ok=True)

    def reserve(self, version: int, size: int) -> ShmSlot:
        """A slot of ``size`` bytes for a push of ``version``, allocated up front (so running out
        of shared memory is an error here, not a SIGBUS in a pusher) and mapped read-write."""
        with self._lock:
            if any(s.version == version for s in self._slots):
                raise ValueError(f"version {version} already has a slot")
            slot = self._free_slot(size)
            try:
                self._generation += 1
                slot.set_generation(self._generation)  # first: a puller still reading the slot's last version sees it
                if slot.fd is None:
                    slot.fd = os.open(slot.path, os.O_RDWR | os.O_CREAT, 0o600)
                current = os.fstat(slot.fd).st_size
                if current != size:
                    slot.unmap()
                    if current:  # a new file, not a truncated one: a puller still mapping the old one gets no SIGBUS
                        slot.path.unlink(missing_ok=True)
                    slot.fd = os.open(slot.path, os.O_RDWR | os.O_CREAT, 0o600)
                    os.ftruncate(slot.fd, size)
                    slot.allocated = 0
                if size and slot.allocated != size:
                    os.posix_fallocate(slot.fd, 0, size)
                    slot.allocated = size
                    if slot.mapping is None:
                        slot.mapping = mmap.mmap(slot.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                self._discard(slot)
                raise
            slot.size, slot.version, slot.visible = size, version, False
            return slot

    def publish(self, version: int, source_fd: int, size: int) -> ShmSlot:
        """Copy ``size`` bytes of ``source_fd`` (a version stored on disk) into a slot."""
        with self._lock:
            for slot in self._slots:
                if slot.version == version:
                    return slot
        slot = self.reserve(version, size)
        try:
            view = slot.view()
            copied = 0
            while copied < size:
                n = os.preadv(source_fd, [view[copied:min(size, copied + (64 << 20))]], copied)
                if n == 0:
                    raise OSError(f"stored version {version} is shorter than {size} bytes")
                copied += n
            view.release()
        except OSError:
            self.release(version, discard=True)
            raise
        slot.visible = True
        return slot

    def _free_slot(self, size: int) -> ShmSlot:
        free = [s for s in self._slots if s.version is None]
        for slot in free:
            if slot.size == size:  # the pullers' and pushers' mappings of it stay valid
                return slot
        if free:
            return free[0]
        slot = ShmSlot(self.directory / f"{self.prefix}-slot{self._next_id}", 0)
        self._next_id += 1
        self._slots.append(slot)
        return slot

    def _discard(self, slot: ShmSlot) -> None:
        slot.unmap()
        slot.close_stamp()
        slot.path.unlink(missing_ok=True)
        slot.stamp_path.unlink(missing_ok=True)
        if slot in self._slots:
            self._slots.remove(slot)

    def slot_of(self, version: int) -> ShmSlot | None:
        with self._lock:
            return next((s for s in self._slots if s.version == version), None)

    def release(self, version: int, discard: bool = False) -> None:
        """The version is gone and unread: its slot may take another one. ``discard``: unlink it
        instead (a pusher that may still write through its mapping then writes into nothing
        anyone reads)."""
        with self._lock:
            for slot in list(self._slots):
                if slot.version == version:
                    slot.version, slot.visible = None, False
                    if discard:
                        self._discard(slot)
            free = [s for s in self._slots if s.version is None]
            for slot in free[self.spare:]:
                self._discard(slot)

    def usage(self) -> dict:
        with self._lock:
            return {"slots": len(self._slots), "bytes": sum(s.size for s in self._slots),
                    "versions": sorted(s.version for s in self._slots if s.version is not None and s.visible)}

    def close(self) -> None:
        with self._lock:
            for slot in list(self._slots):
                self._discard(slot)


class _Mapping:
    def __init__(self, path: str, writable: bool = False):
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino, st.st_size)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot) if st.st_size else None
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, np.uint8) if self.map is not None else np.empty(0, np.uint8)
        self.view = self.array.data

    def close(self) -> None:
        self.view.release()
        self.array = np.empty(0, np.uint8)  # lets go of the mapped bytes
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: it unmaps when collected
                self.map.close()


class _SlotStamp:
    """A puller's view of the generation stamp of the slot its lease reads."""

    def __init__(self, word: np.ndarray | None, lease: PullLease):
        self.word = word  # None: the stamp segment is gone (the slot was trimmed after the lease lapsed)
        self.generation = int(lease.details["generation"])
        self.version = lease.manifest.version

    def check(self) -> None:
        """Raises ``SlotReused`` unless the slot still holds the lease's generation. Called after
        a copy thread handed a batch over (through the pool's lock), so every byte of that batch was
        read before the stamp is."""
        current = int(self.word[0]) if self.word is not None else None
        if current != self.generation:
            raise SlotReused(self.version, self.generation, current)


def default_workers() -> int:
    """Copy-and-checksum threads: both release the GIL, so one per core (at most 4)."""
    return max(1, min(4, os.cpu_count() or 1))


def gather_and_hash(target: np.ndarray, source: ByteRegions, offset: int, algorithm: str) -> str:
    """Copy data-section bytes [offset, offset + len(target)) of ``source`` into ``target`` (a
    push into the slot) window by window, and return their checksum: each window's pieces are
    gathered with one ``np.concatenate`` and the window is hashed once, while it is in cache.
    Windows of ``ALIGNED_PIECE_BYTES`` where every source byte and its destination are mutually
    aligned, else ``PIECE_BYTES`` (see ``copy_window_bytes``). The cut into windows is
    ``source``'s, kept across pushes of the same buffers: a table of thousands of small tensors
    costs a call per window, not per tensor."""
    window = copy_window_bytes(target, source, offset)
    hasher = ChunkHasher(algorithm)
    for start, parts in source.windows(offset, len(target), window):
        step = target[start:start + window]
        if len(parts) == 1:
            np.copyto(step, parts[0])
        else:
            np.concatenate(parts, out=step)
        hasher.update(step)
    return hasher.hexdigest()


def scatter_and_hash(source: np.ndarray, into: ByteRegions, offset: int,
                     hasher: ChunkHasher | SegmentHasher | None) -> str | None:
    """Copy ``source`` (a chunk in the slot, immutable while the lease is open) into data-section
    bytes [offset, offset + len(source)) of ``into``, window by window, hashing each window of the
    source once right after its copy when ``hasher`` is given; the reverse of ``gather_and_hash``,
    with ``into``'s cut into windows kept across pulls into the same buffers."""
    window = copy_window_bytes(source, into, offset)
    for start, parts in into.windows(offset, len(source), window):
        step = source[start:start + window]
        if len(parts) == 1:
            np.copyto(parts[0], step)
        else:
            position = 0
            for part in parts:
                np.copyto(part, step[position:position + len(part)])
                position += len(part)
        if hasher is not None:
            hasher.update(step)
    return hasher.hexdigest() if hasher is not None else None


def copy_window_bytes(whole: np.ndarray, regions: ByteRegions, offset: int) -> int:
    """The copy step between ``whole`` (data-section bytes from ``offset``) and ``regions``:
    ``ALIGNED_PIECE_BYTES`` where every byte keeps its alignment, else ``PIECE_BYTES``."""
    phase = regions.phase(COPY_ALIGNMENT)
    aligned = phase is not None and (address_of(whole) - offset) % COPY_ALIGNMENT == phase
    return ALIGNED_PIECE_BYTES if aligned else PIECE_BYTES


class ShmTransport(Transport):
    """Client side: copy out of (pull) or into (push) the PS's slot; mappings are cached per slot
    (see module doc). Chunks are copied and checksummed by ``workers`` threads at once."""

    name = "shm"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._mappings: dict[tuple[str, bool], _Mapping] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shm-copy")
        return self._pool

    def _mapping(self, path: str, writable: bool = False) -> _Mapping:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise TransportUnavailable(f"shared-memory segment {path} is not on this host; use 'http'") from None
        key = (path, writable)
        with self._lock:
            for gone in [k for k in self._mappings if k != key and not os.path.exists(k[0])]:
                self._mappings.pop(gone).close()  # a trimmed slot: let its memory go
            cached = self._mappings.get(key)
            if cached is not None and cached.identity == (st.st_dev, st.st_ino, st.st_size):
                return cached
            if cached is not None:
                cached.close()
            mapping = self._mappings[key] = _Mapping(path, writable)
            return mapping

    @staticmethod
    def _check_host(details: Mapping[str, Any]) -> None:
        if details.get("host_id") != host_id():
            raise TransportUnavailable("the parameter server runs on another host (or boot); use 'http'")

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        self._check_host(lease.details)
        source = self._mapping(lease.details["path"]).view
        base = lease.manifest.data_offset
        if len(source) < base + lease.manifest.total_bytes:
            raise TransportUnavailable(f"segment {lease.details['path']} is shorter than version {lease.manifest.version}")
        for chunk in lease.manifest.chunks:
            for offset, length in pieces_of(chunk, PIECE_BYTES):
                position = base + offset
                for view in into.views(offset, length):
                    view[:] = source[position:position + len(view)]
                    position += len(view)
                yield offset, length

    def _guard(self, lease: PullLease, verify: bool | str) -> tuple[_SlotStamp | None, bool]:
        """(the slot's stamp to check, whether to hash every chunk) for ``verify`` (see
        ``verify_mode``): ``auto`` checks the stamp alone, unless the PS hands out none."""
        mode = verify_mode(verify)
        if mode != "auto" or "generation" not in lease.details:
            return None, mode != "none"
        try:
            word = self._mapping(lease.details["stamp_path"]).array[:8].view(np.uint64)
        except TransportUnavailable:  # on this host (checked), so the slot was trimmed: its lease lapsed
            word = None
        stamp = _SlotStamp(word, lease)
        stamp.check()
        return stamp, False

    def _slot(self, lease: PullLease, stamp: _SlotStamp | None) -> _Mapping:
        """The mapping of the lease's slot, checked to hold the whole version."""
        mapping = self._mapping(lease.details["path"])
        if len(mapping.view) < lease.manifest.data_offset + lease.manifest.total_bytes:
            if stamp is not None:
                stamp.check()  # the slot went to a smaller version since the stamp was read: say that
            raise TransportUnavailable(f"segment {lease.details['path']} is shorter than version {lease.manifest.version}")
        return mapping

    def pull_verified(self, lease: PullLease, into: ByteRegions, verify: bool | str) -> Iterator[int]:
        """Copies whole chunks on the worker threads, verified as ``verify`` says (``verify_mode``);
        yields the end of the data section verified so far, in order, as chunks complete."""
        self._check_host(lease.details)
        stamp, hashing = self._guard(lease, verify)
        source = self._slot(lease, stamp).view
        base = lease.manifest.data_offset

        slot = np.frombuffer(source, np.uint8)

        def batch(chunks: Sequence[ChunkSpec]) -> int:
            for chunk in chunks:
                hasher = chunk_hasher(chunk) if hashing and chunk.checksum else None
                start = base + chunk.offset
                actual = scatter_and_hash(slot[start:start + chunk.length], into, chunk.offset, hasher)
                if hasher is not None and actual != chunk.checksum:
                    raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual or "")
            return chunks[-1].offset + chunks[-1].length

        yield from _checked(_in_order(self._executor(), batch, batches_of(lease.manifest.chunks), self.workers * 2), stamp)

    def read_chunk(self, lease: PullLease, chunk: ChunkSpec, into: ByteRegions, verify: bool | str) -> None:
        """One chunk of the lease's slot into ``into`` on this thread, verified as ``verify`` says:
        the stamp read before the copy and again after it, or (``checksum``) the chunk hashed as it
        is copied. For a peer's copy read chunk by chunk as its chunks land (``peer_reads``)."""
        self._check_host(lease.details)
        stamp, hashing = self._guard(lease, verify)
        mapping = self._slot(lease, stamp)
        start = lease.manifest.data_offset + chunk.offset
        hasher = chunk_hasher(chunk) if hashing and chunk.checksum else None
        actual = scatter_and_hash(mapping.array[start:start + chunk.length], into, chunk.offset, hasher)
        if hasher is not None and actual != chunk.checksum:
            raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual or "")
        if stamp is not None:
            stamp.check()

    def pull_selected(self, lease: PullLease, plan: SelectionPlan, targets: Sequence[np.ndarray],
                      verify: bool | str) -> Iterator[int]:
        """Copies only the selected bytes out of the slot (strided copies for slices along dim > 0)
        into ``targets`` (one flat byte buffer per selected tensor, in ``plan.tensors`` order).
        Verified as ``verify`` says: the slot's stamp, or (``checksum``) each touched chunk hashed
        whole in the slot -- immutable while the lease is open -- piece by piece, each piece after
        its selected bytes were copied. Chunks go to the worker threads; yields the end of the data
        section verified so far, in order, as touched chunks complete."""
        self._check_host(lease.details)
        stamp, hashing = self._guard(lease, verify)
        mapping = self._slot(lease, stamp)
        base = lease.manifest.data_offset
        source, view = mapping.array, mapping.view

        def one(step: ChunkStep) -> int:
            chunk = step.chunk
            hasher = chunk_hasher(chunk) if hashing and chunk.checksum else None
            for offset, length in pieces_of(chunk, PIECE_BYTES):  # each piece hashed right after its copy, in cache
                copy_blocks(step.copies_within(offset, offset + length), source, -base, targets)
                if hasher is not None:
                    hasher.update(view[base + offset:base + offset + length])
            if hasher is not None:
                actual = hasher.hexdigest()
                if actual != chunk.checksum:
                    raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual)
            return chunk.offset + chunk.length

        yield from _checked(_in_order(self._executor(), one, plan.steps, self.workers * 2), stamp)

    def push(self, session: PushSession, source: ByteRegions) -> dict[int, str | list[str]]:
        """Write the session's chunks straight into the PS's slot; returns their checksums,
        computed over the bytes as they landed in the slot. A gathered chunk (a rank's many small
        shards) is copied range by range, each range hashed right after its copy; its entry is
        the list of its ranges' checksums, from which the PS makes the checksums of the
        version's chunks that join several parts' ranges (see ``ChunkSpec``)."""
        self._check_host(session.details)
        try:
            target = self._mapping(session.details["path"], writable=True).view
        except TransportUnavailable as exc:  # on the PS's host (checked): the slot went with a dropped push
            raise FileNotFoundError(f"push {session.push_id}: its shared-memory slot is gone (the push was "
                                    f"dropped or the parameter server restarted)") from exc
        base = int(session.details["data_offset"])
        slot = np.frombuffer(target, np.uint8)

        def batch(chunks: Sequence[ChunkSpec]) -> list[tuple[int, str | list[str]]]:
            sums: list[tuple[int, str | list[str]]] = []
            for chunk in chunks:
                if chunk.ranges:
                    sums.append((chunk.index, copy_ranges(target, base, chunk.ranges, source, session.checksum_algorithm)))
                    continue
                start = base + chunk.offset
                sums.append((chunk.index, gather_and_hash(slot[start:start + chunk.length], source, chunk.offset,
                                                          session.checksum_algorithm)))
            return sums

        return {index: checksum for sums in _in_order(self._executor(), batch, batches_of(session.chunks), self.workers * 2)
                for index, checksum in sums}

    def close(self) -> None:
        with self._lock:
            for mapping in self._mappings.values():
                mapping.close()
            self._mappings.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def copy_ranges(target: memoryview, base: int, ranges: Sequence[tuple[int, int]], source: ByteRegions,
                algorithm: str) -> list[str]:
    """Copy data-section ``ranges`` of ``source`` to ``target[base + offset:]`` and return each
    range's checksum, hashed where it landed right after its copy (in cache): one numpy copy and
    one hash call per range (a range is one or a few of the caller's buffers, which a copy
    cannot join; the small ranges this is for fit in cache)."""
    slot = np.frombuffer(target, np.uint8)
    checksums = []
    for offset, length in ranges:
        destination = slot[base + offset:base + offset + length]
        views = source.views(offset, length)
        if len(views) == 1:
            np.copyto(destination, np.frombuffer(views[0], np.uint8))
        else:
            np.concatenate([np.frombuffer(v, np.uint8) for v in views], out=destination)
        checksums.append(checksum_bytes(algorithm, destination))
    return checksums


BATCH_BYTES = 4 << 20  # small chunks go to the copy threads together, up to this many bytes


def batches_of(chunks: Sequence[ChunkSpec], batch_bytes: int = BATCH_BYTES) -> list[list[ChunkSpec]]:
    """Consecutive chunks grouped into batches of at least ``batch_bytes`` (a big chunk alone):
    a rank of several pushes one small chunk per tensor it holds rows of, and a task per chunk on
    the copy threads would cost more than the copy."""
    batches: list[list[ChunkSpec]] = []
    filled = batch_bytes
    for chunk in chunks:
        if filled >= batch_bytes:
            batches.append([])
            filled = 0
        batches[-1].append(chunk)
        filled += chunk.length
    return batches


def _checked(ends: Generator[int, None, None], stamp: _SlotStamp | None) -> Iterator[int]:
    """``ends`` (verified prefixes, from the copy threads), each passed on only once the slot's
    stamp still holds the lease's generation after its bytes were copied."""
    if stamp is None:
        yield from ends
        return
    try:
        for end in ends:
            stamp.check()
            yield end
    finally:
        ends.close()  # on an error: cancel the copies still queued, and wait for those running


def _in_order(pool: ThreadPoolExecutor, fn: Callable[[Any], T], items: Sequence[Any], window: int) -> Generator[T, None, None]:
    """``fn`` over ``items`` on the pool, at most ``window`` in flight, results in order. On an
    error the rest is cancelled (and waited for: they write into the caller's buffers)."""
    pending: deque[Future] = deque()
    position = 0
    try:
        while position < len(items) or pending:
            while position < len(items) and len(pending) < window:
                pending.append(pool.submit(fn, items[position]))
                position += 1
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        wait(pending)
