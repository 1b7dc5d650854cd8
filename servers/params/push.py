"""Pushes in progress (``PushTable``): a version's parts join, deliver their chunks (over HTTP
through ``ChunkWriter``, or written into the memory slot by the pusher over shm or NIXL and
handed in with their checksums), and the last part to finish makes the version visible in the
store, its chunk table cut anew (``rules.manifest_chunks``). The table shares the store's lock."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np

from staleflow.config import ParamsConfig
from staleflow.errors import ErrorCode
from staleflow.servers.params.rules import (
    ParamsError,
    PendingPush,
    PushPart,
    StoredVersion,
    claimed_checksums,
    coverage_gaps,
    manifest_chunks,
    split_ranges,
)
from staleflow.transports.checksums import (
    SegmentHasher,
    checksum_algorithm,
    checksum_algorithms,
    chunk_checksums,
    chunk_hasher,
)
from staleflow.transports.errors import FormatError
from staleflow.transports.http import CHECKSUM_HEADER
from staleflow.transports.layout import ChunkSpec, Manifest, TensorSpec, laid_table, safetensors_header
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import ShmSlot, ShmSlots, default_workers

if TYPE_CHECKING:
    from staleflow.transports.nixl import NixlExporter

log = logging.getLogger(__name__)


class PushHost(Protocol):
    """What the push table needs of the store that owns it (``ParamStore``): its settings, its lock,
    its versions and memory tier, and where a version made visible goes."""

    config: ParamsConfig
    cond: threading.Condition
    versions: dict[int, StoredVersion]
    referenced: dict[int, Manifest]  # versions whose copy the store dropped: its holders serve them
    memory: ShmSlots
    nixl: NixlExporter | None

    def sweep_locked(self) -> None: ...

    def publish(self, stored: StoredVersion) -> None: ...

TABLES_KEPT = 8  # tensor tables a PS remembers by digest (a job pushes one)
HEADER_ALIGN = 4096  # the data section starts page-aligned, and the header size does not change with the version number


class ChunkWriter:
    """Receives one chunk of a push piece by piece (as the HTTP server hands them over), copying
    each straight into the version's memory slot at the chunk's ranges and checksumming it there,
    while it is in cache: no buffering, no thread hop (a piece is tens of KiB)."""

    def __init__(self, table: PushTable, push: PendingPush, part: PushPart, chunk: ChunkSpec, claimed: str):
        self.table, self.push, self.part, self.chunk, self.claimed = table, push, part, chunk, claimed
        self.hasher = chunk_hasher(chunk, checksum_algorithm(claimed))  # a gathered chunk: range by range
        self.written = 0
        slot = np.frombuffer(push.slot.view(), np.uint8)
        self.targets: list[np.ndarray] | None = [slot[push.data_offset + o:push.data_offset + o + n] for o, n in chunk.spans()]
        self._span, self._at = 0, 0  # where the next byte lands: which target, how far into it

    def add(self, piece: bytes) -> None:
        if self.written + len(piece) > self.chunk.length:
            raise ParamsError(ErrorCode.BODY_TOO_LARGE, f"chunk {self.chunk.index} is {self.chunk.length} bytes; the body is longer")
        source = np.frombuffer(piece, np.uint8)
        taken = 0
        while taken < len(source):
            target = self._current()
            n = min(len(target), len(source) - taken)
            np.copyto(target[:n], source[taken:taken + n])
            taken += n
            self.landed(n)

    def _current(self) -> np.ndarray:
        assert self.targets is not None
        return self.targets[self._span][self._at:]

    def remaining(self) -> list[memoryview]:
        """Where the rest of the chunk goes, in order, for a receiver that writes into it itself
        (the data plane's ``recv_into``); it calls ``landed`` after each piece, in order, a
        piece never crossing from one of these views into the next."""
        assert self.targets is not None
        return [self._current().data, *(t.data for t in self.targets[self._span + 1:])]

    def landed(self, n: int) -> None:
        """``n`` more bytes are in place: checksum them while they are in cache."""
        assert self.targets is not None
        target = self.targets[self._span]
        if self._at + n > len(target):
            raise ValueError(f"a piece of {n} bytes crosses the end of range {self._span} of chunk {self.chunk.index}")
        self.hasher.update(target[self._at:self._at + n])
        self.written += n
        self._at += n
        while self._span < len(self.targets) - 1 and self._at == len(self.targets[self._span]):
            self._span, self._at = self._span + 1, 0

    def finish(self) -> str:
        self.targets = None
        actual = self.hasher.hexdigest()
        if self.written != self.chunk.length:
            self.table.chunk_done(self.push, self.part, self.chunk.index, None)
            raise ParamsError(ErrorCode.INCOMPLETE_CHUNK, f"chunk {self.chunk.index}: received {self.written} of {self.chunk.length} bytes")
        if actual != self.claimed:
            self.table.chunk_done(self.push, self.part, self.chunk.index, None)
            raise ParamsError(ErrorCode.CHECKSUM_MISMATCH, f"chunk {self.chunk.index}: bad checksum: the body hashes to {actual}, "
                                         f"the request claims {self.claimed}; the chunk was not stored, send it again")
        ranges = tuple(self.hasher.checksums) if isinstance(self.hasher, SegmentHasher) else None
        self.table.chunk_done(self.push, self.part, self.chunk.index, actual, ranges)
        return actual

    def abandon(self) -> None:
        self.targets = None
        self.table.chunk_done(self.push, self.part, self.chunk.index, None)


class PushTable:
    """The pushes in progress, by version, and the tensor tables sent (by digest). Owned by the
    store, under its lock (``cond``); a version made visible is handed to ``store.publish``."""

    def __init__(self, store: PushHost):
        self.store = store
        self._cond = store.cond
        self.pending: dict[int, PendingPush] = {}
        self._tables: dict[str, tuple[TensorSpec, ...]] = {}  # tables sent, by digest, newest last
        self.committed = 0  # since this server started

    def join_push(self, version: int, part: int, parts: int, tensors: Iterable[tuple[str, str, list[int]]] | None,
                  metadata: Mapping[str, str], ranges: Sequence[tuple[int, int]] | None, via: str,
                  gather: bool = False, table: str | None = None) -> tuple[PendingPush, PushPart]:
        """Part ``part`` of ``parts`` joins the push of ``version`` (the first to arrive starts it).
        Every part names the whole tensor table (``tensors``, or ``table``: the digest of one sent
        before) and its own byte ranges of the data section (``None``: all of it); the version
        becomes visible once the parts' ranges tile the data section and every part is done. A
        part that joins again (a restarted pusher) starts over. ``gather``: the pusher takes
        chunks of several ranges (see ``split_ranges``)."""
        laid, digest = self._table(tensors, table)
        total = sum(t.nbytes for t in laid)
        if not 0 <= part < parts:
            raise ParamsError(ErrorCode.INVALID_PART, f"part {part} is outside 0..{parts - 1}")
        if via not in ("http", "shm", "nixl"):
            raise ParamsError(ErrorCode.INVALID_PART, f"a part is pushed over 'http', 'shm' or 'nixl', not {via!r}")
        ranges = [(0, total)] if ranges is None else [(int(o), int(n)) for o, n in ranges]
        for offset, length in ranges:
            if offset < 0 or length < 0 or offset + length > total:
                raise ParamsError(ErrorCode.INVALID_PART, f"range {offset}+{length} is outside the {total}-byte data section")
        overlaps, _ = coverage_gaps(ranges, total)
        if overlaps:
            raise ParamsError(ErrorCode.INVALID_PART, f"part {part}'s ranges overlap themselves at {overlaps[:3]}")
        with self._cond:
            self.store.sweep_locked()
            if version in self.store.versions or version in self.store.referenced:  # held here, or by holders (ROS)
                raise ParamsError(ErrorCode.VERSION_EXISTS, f"version {version} already exists; versions are immutable, push a new number")
            push = self.pending.get(version)
            if push is None:
                newest = max((*self.store.versions, *self.store.referenced), default=None)
                if newest is not None and version < newest:
                    raise ParamsError(ErrorCode.VERSION_TOO_OLD, f"version {version} is older than the newest complete version {newest}")
                push = self._start_push(version, laid, total, metadata, parts)
                push.table = digest
            elif push.tensors != laid or push.expected_parts != parts:
                raise ParamsError(ErrorCode.PART_CONFLICT, f"a push of version {version} with another tensor table or number of parts is "
                                              f"in progress (push_id {push.push_id}); finish or abort it first")
            elif push.committing:
                raise ParamsError(ErrorCode.BUSY, f"version {version} is being committed")
            previous = push.parts.get(part)
            if previous is not None and previous.writing:
                raise ParamsError(ErrorCode.BUSY, f"part {part} of version {version} is receiving a chunk right now")
            others = [r for i, p in push.parts.items() if i != part for r in p.ranges()]
            overlaps, _ = coverage_gaps(others + ranges, total)
            if overlaps:
                raise ParamsError(ErrorCode.PART_CONFLICT,
                                  f"part {part}'s ranges overlap another part's at {overlaps[:3]} (offset, length)")
            entry = PushPart(part, via, split_ranges(ranges, self.store.config.chunk_bytes, gather))
            push.parts[part] = entry
            push.metadata.update(metadata)
            push.last_active = time.monotonic()
            return push, entry

    def _table(self, tensors: Iterable[tuple[str, str, list[int]]] | None, table: str | None) -> tuple[tuple[TensorSpec, ...], str]:
        """A join's tensor table, laid out, and its digest: from the tensors sent (remembered by
        digest), or the digest of a table sent before."""
        if tensors is not None:
            laid, digest = laid_table(tensors, self.store.config.max_tensors)
            if table is not None and table != digest:
                raise ParamsError(ErrorCode.INVALID_PART, f"table {table} is not the digest of the tensors sent ({digest})")
            with self._cond:
                self._tables.pop(digest, None)
                self._tables[digest] = laid
                while len(self._tables) > TABLES_KEPT:
                    self._tables.pop(next(iter(self._tables)))
            return laid, digest
        if table is None:
            raise ParamsError(ErrorCode.INVALID_PART, "a join names its tensor table: send the tensors, or the table's digest "
                                                      "(the 'table' a join answered)")
        with self._cond:
            known = self._tables.get(table)
        if known is None:
            raise ParamsError(ErrorCode.UNKNOWN_TABLE, f"tensor table {table} is not known here (the parameter server restarted, "
                                                       f"or another one answered): send the tensors")
        return known, table

    def _start_push(self, version: int, laid: tuple[TensorSpec, ...], total: int, metadata: Mapping[str, str],
                    parts: int) -> PendingPush:
        header = safetensors_header(laid, {"format": "pt", **metadata, "staleflow_version": str(version)}, HEADER_ALIGN)
        try:
            slot = self.store.memory.reserve(version, len(header) + total)
        except OSError as exc:
            raise ParamsError(ErrorCode.MEMORY_FULL, f"no room for version {version} ({len(header) + total} bytes) in "
                                             f"{self.store.config.shm_dir}: {exc}") from None
        assert slot.fd is not None  # a reserved slot is open
        os.pwrite(slot.fd, header, 0)
        push = PendingPush(uuid.uuid4().hex, version, laid, total, slot, len(header), dict(metadata), parts)
        self.pending[version] = push
        log.info("push of version %d started: %d tensors, %d bytes, %d part(s)", version, len(laid), total, parts)
        return push

    def nixl_push_details(self, push: PendingPush) -> dict:
        """For a part pushed over NIXL: the push's slot registered with the PS's NIXL agent (once
        per push, until it commits or is dropped) and what the pusher needs to WRITE into it."""
        if self.store.nixl is None:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED, "NIXL is not enabled here; push the part over http")
        assert push.slot.mapping is not None
        details = self.store.nixl.push_details(push.push_id, int(np.frombuffer(push.slot.mapping, np.uint8).ctypes.data),
                                         push.data_offset, push.total_bytes)
        with self._cond:
            if self.pending.get(push.version) is not push:  # dropped while it was being registered
                self.store.nixl.release_push(push.push_id)
                raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"the push of version {push.version} was dropped: {push.dropped}; push it again")
        return details

    def begin_push(self, version: int, tensors: Iterable[tuple[str, str, list[int]]], metadata: Mapping[str, str]) -> PendingPush:
        """A push by one pusher of the whole version (one part, chunks of ``chunk_bytes``)."""
        with self._cond:
            if version in self.pending:
                push = self.pending[version]
                raise ParamsError(ErrorCode.PUSH_IN_PROGRESS, f"a push of version {version} is in progress (push_id {push.push_id}); "
                                              "finish or abort it first")
        push, _ = self.join_push(version, 0, 1, tensors, metadata, None, "http")
        return push

    def _push(self, version: int, push_id: str) -> PendingPush:
        push = self.pending.get(version)
        if push is None:
            state = "is complete" if version in self.store.versions else "has no push in progress"
            raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"version {version} {state}; start one with POST /v1/params/{version}")
        if push.push_id != push_id:
            raise ParamsError(ErrorCode.PUSH_ID_MISMATCH, f"push_id {push_id!r} does not match the push of version {version} in progress")
        return push

    def _part(self, push: PendingPush, part: int) -> PushPart:
        entry = push.parts.get(part)
        if entry is None:
            raise ParamsError(ErrorCode.UNKNOWN_PART, f"part {part} has not joined the push of version {push.version}")
        return entry

    def chunk_writer(self, version: int, push_id: str, index: int, claimed: str | None, length: int | None,
                     part: int = 0) -> ChunkWriter:
        if claimed is None:
            raise ParamsError(ErrorCode.MISSING_CHECKSUM,
                              f"header {CHECKSUM_HEADER} is missing: send 'xxh3_64:<hex>' or 'crc32:<hex>' of the chunk")
        try:
            checksum_algorithm(claimed)
        except FormatError as exc:
            raise ParamsError(ErrorCode.INVALID_FORMAT, str(exc)) from None
        with self._cond:
            push = self._push(version, push_id)
            entry = self._part(push, part)
            if not 0 <= index < len(entry.chunks):
                raise ParamsError(ErrorCode.UNKNOWN_CHUNK,
                                  f"part {part} of version {version} has chunks 0..{len(entry.chunks) - 1}, not {index}")
            chunk = entry.chunks[index]
            if length is not None and length != chunk.length:
                code = ErrorCode.BODY_TOO_LARGE if length > chunk.length else ErrorCode.CHUNK_LENGTH_MISMATCH
                raise ParamsError(code, f"chunk {index} is {chunk.length} bytes; Content-Length says {length}")
            if index in entry.writing or push.committing or entry.done:
                raise ParamsError(ErrorCode.BUSY, f"chunk {index} of version {version} is being received or committed right now")
            entry.writing.add(index)
            entry.received.pop(index, None)
            entry.range_checksums.pop(index, None)
            push.last_active = time.monotonic()
        return ChunkWriter(self, push, entry, chunk, claimed)

    def chunk_done(self, push: PendingPush, part: PushPart, index: int, checksum: str | None,
                   range_checksums: tuple[str, ...] | None = None) -> None:
        with self._cond:
            part.writing.discard(index)
            if checksum is not None:
                part.received[index] = checksum
                if range_checksums is not None:
                    part.range_checksums[index] = range_checksums
            push.last_active = time.monotonic()

    def finish_part(self, version: int, push_id: str, part: int, checksums: Mapping[int, str | list[str]] | None = None,
                    wait_s: float = 0.0) -> dict:
        """Part ``part`` has delivered its chunks (a part written over shared memory or NIXL hands
        in its chunks' checksums here). Returns the push's state; the last part to finish makes the
        version visible. ``wait_s``: wait that long for the other parts."""
        if checksums is not None and self._verify_landed(version, push_id, part, checksums):
            checksums = None  # a part written over NIXL: its verified chunks are recorded already
        with self._cond:
            push = self._push(version, push_id)
            entry = self._part(push, part)
            if checksums is not None:
                if entry.via != "shm":
                    raise ParamsError(ErrorCode.INVALID_PART, f"part {part} sends its chunks over http; checksums come with each chunk")
                claimed, ranges = claimed_checksums(entry, checksums)
                entry.received.update(claimed)
                entry.range_checksums.update(ranges)
                # a gathered chunk handed in without checksums is hashed in the slot at commit
                entry.received.update({c.index: None for c in entry.chunks if c.ranges and c.index not in entry.received})
            _check_delivered(version, entry, f" of part {part}")
            entry.done = True
            push.last_active = time.monotonic()
            if len(push.parts) == push.expected_parts and all(p.done for p in push.parts.values()) and not push.committing:
                self._commit(push)  # waits for the lock again while it hashes
            deadline = time.monotonic() + wait_s
            while version not in self.store.versions and push.dropped is None and time.monotonic() < deadline:
                self._cond.wait(min(1.0, deadline - time.monotonic()))
            if push.dropped is not None and version not in self.store.versions:
                raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"the push of version {version} was dropped: {push.dropped}; push it again")
            if version in self.store.versions:
                return {"version": version, "visible": True, **self.store.versions[version].summary()}
            return {"version": version, "visible": False, **push.progress()}

    def _verify_landed(self, version: int, push_id: str, part: int, checksums: Mapping[int, str | list[str]]) -> bool:
        """A part written over NIXL hands in checksums of its *source* bytes: hash the bytes that
        landed in the slot (off the lock; on a few threads, off the GIL) and record the chunks
        that match. A mismatch leaves the part not done. False for parts not written over NIXL."""
        with self._cond:
            push = self._push(version, push_id)
            entry = self._part(push, part)
            if entry.via != "nixl":
                return False
            if entry.writing or push.committing:
                raise ParamsError(ErrorCode.BUSY, f"part {part} of version {version} is being verified or committed right now")
            claimed, ranges = claimed_checksums(entry, checksums)
            entry.writing.update(claimed)  # not swept, aborted or joined again while it is hashed
            for index in claimed:
                entry.received.pop(index, None)
            push.last_active = time.monotonic()
        chunks = [entry.chunks[i] for i in sorted(claimed)]
        landed: list[str] = []
        try:
            landed = hash_chunks(push.slot, push.data_offset, push.total_bytes, chunks,
                                  [checksum_algorithm(claimed[c.index]) for c in chunks], "params-verify")
        finally:
            with self._cond:
                entry.writing.difference_update(claimed)
                for chunk, actual in zip(chunks, landed, strict=False):
                    if actual == claimed[chunk.index]:
                        entry.received[chunk.index] = actual
                        if chunk.index in ranges:  # they hash to what landed
                            entry.range_checksums[chunk.index] = ranges[chunk.index]
                push.last_active = time.monotonic()
                self._cond.notify_all()
        mismatched = [(c.index, actual, claimed[c.index]) for c, actual in zip(chunks, landed, strict=True) if actual != claimed[c.index]]
        if mismatched:
            index, actual, expected = mismatched[0]
            raise ParamsError(ErrorCode.CHECKSUM_MISMATCH,
                              f"part {part} of version {version}: {len(mismatched)} chunk(s) landed other than the pusher hashed them "
                              f"(chunk {index}: {actual} in the PS's memory, {expected} claimed); the part is not done, push it again")
        return True

    def _commit(self, push: PendingPush) -> None:
        """Under the lock: every part is done; make the version visible if the parts tile it. The
        manifest's chunks are cut anew over the data section (``manifest_chunks``); those that
        join several delivered chunks are hashed in the slot first, off the lock (``committing``
        keeps the push from being joined, aborted or swept meanwhile)."""
        _, gaps = coverage_gaps([r for p in push.parts.values() for r in p.ranges()], push.total_bytes)
        if gaps:
            raise ParamsError(ErrorCode.PART_CONFLICT,
                              f"version {push.version}: the parts leave bytes {gaps[:3]} (offset, length) uncovered")
        push.committing = True
        delivered = [(c, p.received[c.index], p.range_checksums.get(c.index)) for p in push.parts.values() for c in p.chunks]
        chunks = manifest_chunks(delivered, self.store.config.chunk_bytes)
        unhashed = [c for c in chunks if c.checksum is None]
        if unhashed:
            algorithm = next((checksum_algorithm(x) for _, x, _ in delivered if x is not None), checksum_algorithms()[0])
            self._cond.release()  # held once: finish_part takes it for this call alone
            try:
                sums = iter(hash_chunks(push.slot, push.data_offset, push.total_bytes, unhashed,
                                         [algorithm] * len(unhashed), "params-commit"))
            except BaseException:
                push.committing = False  # a later done tries again
                raise
            finally:
                self._cond.acquire()
            if push.dropped is not None:
                raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"the push of version {push.version} was dropped: {push.dropped}; push it again")
            chunks = [c if c.checksum is not None else ChunkSpec(c.index, c.offset, c.length, next(sums)) for c in chunks]
        manifest = Manifest(
            version=push.version, tensors=push.tensors, chunks=tuple(chunks),
            chunk_bytes=self.store.config.chunk_bytes, data_offset=push.data_offset, metadata=push.metadata,
            committed_at=time.time(),
        )
        push.slot.visible = True
        stored = StoredVersion(manifest, push.fd, push.data_offset + push.total_bytes, slot=push.slot,
                               visible_seconds=time.monotonic() - push.started, visible_at_monotonic=time.monotonic())
        del self.pending[push.version]
        if self.store.nixl is not None:
            self.store.nixl.release_push(push.push_id)
        self.committed += 1
        self.store.publish(stored)
        log.info("version %d visible (%d bytes, %d chunks, %d hashed at commit, %.3f s after the push began)", push.version,
                 manifest.total_bytes, len(manifest.chunks), len(unhashed), stored.visible_seconds)

    def commit(self, version: int, push_id: str) -> Manifest:
        """The one-pusher API's commit: finish part 0 and return the visible version's manifest."""
        with self._cond:
            push = self._push(version, push_id)
            if push.committing:
                raise ParamsError(ErrorCode.BUSY, f"version {version} is being committed already")
            if push.expected_parts != 1:
                raise ParamsError(ErrorCode.PART_CONFLICT,
                                  f"version {version} is pushed in {push.expected_parts} parts; each part finishes itself")
            _check_delivered(version, self._part(push, 0))
        self.finish_part(version, push_id, 0)  # not under the lock: the commit lets it go while it hashes
        with self._cond:
            return self.store.versions[version].manifest

    def abort_push(self, version: int, push_id: str) -> None:
        with self._cond:
            push = self._push(version, push_id)
            if push.committing or push.writing:
                raise ParamsError(ErrorCode.BUSY, f"version {version} is being committed or received right now")
            self._drop_push(push, "aborted")
            self._cond.notify_all()

    def drop_all(self, why: str) -> None:
        """Under the lock: every push in progress is dropped (the server stops)."""
        for push in list(self.pending.values()):
            self._drop_push(push, why)

    def drop_idle(self, now: float) -> None:
        """Under the lock: pushes idle for longer than ``push_ttl_s`` are dropped."""
        ttl = self.store.config.push_ttl_s
        for push in [p for p in self.pending.values() if not p.writing and not p.committing and now - p.last_active > ttl]:
            waiting = sorted(set(range(push.expected_parts)) - {i for i, p in push.parts.items() if p.done})
            self._drop_push(push, f"idle for {ttl:g} s waiting for part(s) {waiting}")
            self._cond.notify_all()

    def _drop_push(self, push: PendingPush, why: str) -> None:
        del self.pending[push.version]
        push.dropped = why
        # a pusher that still writes through its own mapping (or NIXL) must not write into a reused slot
        if self.store.nixl is not None:
            self.store.nixl.release_push(push.push_id)
        self.store.memory.release(push.version, discard=any(p.via in ("shm", "nixl") for p in push.parts.values()))
        log.info("push of version %d dropped: %s", push.version, why)


def _check_delivered(version: int, entry: PushPart, which: str = "") -> None:
    """A part that is done has every chunk in, and none being received."""
    missing = [c.index for c in entry.chunks if c.index not in entry.received]
    if missing or entry.writing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        reason = f"chunks missing: {shown}" if missing else "chunks are still being received"
        raise ParamsError(ErrorCode.VERSION_INCOMPLETE, f"version {version} is incomplete "
                                                        f"({len(entry.received)}/{len(entry.chunks)} chunks{which}): {reason}")


def hash_chunks(slot: ShmSlot, data_offset: int, total_bytes: int, chunks: Sequence[ChunkSpec],
                 algorithms: Sequence[str], thread_name: str) -> list[str]:
    """The checksums of ``chunks`` (gathered ones over their ranges in order) as they lie in
    ``slot``'s data section, hashed on a few threads (off the lock and the GIL)."""
    view = slot.view()[data_offset:data_offset + total_bytes]
    try:
        with ThreadPoolExecutor(min(default_workers(), max(1, len(chunks))), thread_name_prefix=thread_name) as pool:
            return list(chunk_checksums(ByteRegions.flat(view), chunks, algorithms, pool))
    finally:
        view.release()
