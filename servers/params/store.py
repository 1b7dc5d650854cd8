"""The parameter server's store: immutable versions in host memory, sharded pushes in progress,
pull leases, retention and background persistence. The pure rules they follow (version specs,
retention, part coverage, the records) are ``rules``; a version's folder on disk is ``files``.

Memory first: a push writes straight into a shared-memory slot (``/dev/shm``); the version becomes
visible from it as soon as every part of the push is in and verified. A background thread then
persists it to ``state_dir/versions/vNNNNNNNNNN/`` (one safetensors file plus ``manifest.json``,
written last and renamed into place; ``.staging-*`` folders are what a crash left and a restart
discards). After a crash the newest persisted versions are served again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from staleflow.errors import ErrorCode
from staleflow.servers.params.config import ParamsConfig
from staleflow.servers.params.files import DATA_FILE, MANIFEST_FILE, VERSION_DIR, fsync_dir, load_version, write_atomically
from staleflow.servers.params.rules import (
    Lease,
    ParamsError,
    PendingPush,
    PushPart,
    StoredVersion,
    claimed_checksums,
    coverage_gaps,
    manifest_chunks,
    parse_version_spec,
    shm_prefix,
    split_ranges,
    versions_to_drop,
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

log = logging.getLogger(__name__)


TABLES_KEPT = 8  # tensor tables a PS remembers by digest (a job pushes one)
PERSIST_STEP = 64 << 20  # bytes a persist copies between looks at the traffic
HEADER_ALIGN = 4096  # the data section starts page-aligned, and the header size does not change with the version number


class ChunkWriter:
    """Receives one chunk of a push piece by piece (as the HTTP server hands them over), copying
    each straight into the version's memory slot at the chunk's ranges and checksumming it there,
    while it is in cache: no buffering, no thread hop (a piece is tens of KiB)."""

    def __init__(self, store: ParamStore, push: PendingPush, part: PushPart, chunk: ChunkSpec, claimed: str):
        self.store, self.push, self.part, self.chunk, self.claimed = store, push, part, chunk, claimed
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
        return [memoryview(self._current()), *(memoryview(t) for t in self.targets[self._span + 1:])]

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
            self.store.chunk_done(self.push, self.part, self.chunk.index, None)
            raise ParamsError(ErrorCode.INCOMPLETE_CHUNK, f"chunk {self.chunk.index}: received {self.written} of {self.chunk.length} bytes")
        if actual != self.claimed:
            self.store.chunk_done(self.push, self.part, self.chunk.index, None)
            raise ParamsError(ErrorCode.CHECKSUM_MISMATCH, f"chunk {self.chunk.index}: bad checksum: the body hashes to {actual}, "
                                         f"the request claims {self.claimed}; the chunk was not stored, send it again")
        ranges = tuple(self.hasher.checksums) if isinstance(self.hasher, SegmentHasher) else None
        self.store.chunk_done(self.push, self.part, self.chunk.index, actual, ranges)
        return actual

    def abandon(self) -> None:
        self.targets = None
        self.store.chunk_done(self.push, self.part, self.chunk.index, None)


class ParamStore:
    """Versioned storage with leases, memory first. Thread-safe; metadata under one condition
    variable, bulk copies outside it."""

    def __init__(self, config: ParamsConfig):
        self.config = config
        self.root = config.state_dir / "versions"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(config.state_dir / "params.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OSError(f"another parameter server is using {config.state_dir}; stop it or pick another --state-dir") from None
        self.versions: dict[int, StoredVersion] = {}
        self.pushes: dict[int, PendingPush] = {}
        self._tables: dict[str, tuple[TensorSpec, ...]] = {}  # tables sent, by digest, newest last
        self.leases: dict[str, Lease] = {}
        self.pushes_committed = 0  # since this server started
        self.pulls_started: dict[str, int] = {}  # by transport, since this server started
        self.active_streams = 0
        self._closed = False
        self._cond = threading.Condition()
        self.memory = ShmSlots(config.shm_dir, shm_prefix(config.state_dir))  # the memory tier, shm pulls or not
        self.nixl = None
        if "nixl" in config.transports:
            from staleflow.transports.nixl import NixlExporter

            self.nixl = NixlExporter(f"staleflow-ps-{uuid.uuid4().hex[:8]}")
        self._to_persist: set[int] = set()
        self._trash: list[Path] = []  # evicted versions' folders, deleted by the disk thread
        self._loading = threading.Lock()  # one version loaded from disk into a memory slot at a time
        self._recover()
        self._disk = threading.Thread(target=self._disk_forever, name="params-disk", daemon=True)
        self._disk.start()

    @property
    def shm(self) -> ShmSlots | None:
        """The slots, when shared-memory pulls are offered."""
        return self.memory if "shm" in self.config.transports else None

    # -- startup and shutdown

    def _recover(self) -> None:
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):  # an unfinished persist or a half-deleted version
                log.info("discarding %s", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            match = VERSION_DIR.match(entry.name)
            if not match:
                continue
            try:
                stored = load_version(entry, int(match.group(1)))
            except (OSError, ValueError) as exc:
                log.warning("discarding incomplete version in %s: %s", entry.name, exc)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            self.versions[stored.manifest.version] = stored
        with self._cond:
            self._apply_retention()
        log.info("parameter store at %s holds versions %s", self.root, sorted(self.versions) or "none")

    def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._disk.join()
        for trash in self._trash:
            shutil.rmtree(trash, ignore_errors=True)
        with self._cond:
            for push in list(self.pushes.values()):
                self._drop_push(push, "the parameter server stopped")
            for stored in self.versions.values():
                if stored.slot is None:
                    os.close(stored.fd)
            self.versions.clear()
            self.leases.clear()
        self.memory.close()
        if self.nixl is not None:
            self.nixl.close()
        os.close(self._lock_fd)  # releases the state directory

    # -- retention

    def _apply_retention(self) -> None:
        retained = [v for v, s in self.versions.items() if s.retained]
        for version in versions_to_drop(retained, self.config.keep):
            stored = self.versions[version]
            stored.retained = False
            if stored.leases == 0:
                self._destroy(stored)

    def _destroy(self, stored: StoredVersion) -> None:
        version = stored.manifest.version
        del self.versions[version]
        self._to_persist.discard(version)
        if self.nixl is not None:
            self.nixl.release(version)
        if stored.slot is not None:
            self.memory.release(version)
        else:
            os.close(stored.fd)
        if stored.directory is not None:
            trash = self.root / f".trash-{stored.directory.name}-{uuid.uuid4().hex[:8]}"
            os.rename(stored.directory, trash)
            self._trash.append(trash)  # deleted by the disk thread (a restart removes what a crash left)
            self._cond.notify_all()
        log.info("evicted version %d", version)

    # -- push

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
            self._sweep()
            if version in self.versions:
                raise ParamsError(ErrorCode.VERSION_EXISTS, f"version {version} already exists; versions are immutable, push a new number")
            push = self.pushes.get(version)
            if push is None:
                newest = max(self.versions, default=None)
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
            entry = PushPart(part, via, split_ranges(ranges, self.config.chunk_bytes, gather))
            push.parts[part] = entry
            push.metadata.update(metadata)
            push.last_active = time.monotonic()
            return push, entry

    def _table(self, tensors: Iterable[tuple[str, str, list[int]]] | None, table: str | None) -> tuple[tuple[TensorSpec, ...], str]:
        """A join's tensor table, laid out, and its digest: from the tensors sent (remembered by
        digest), or the digest of a table sent before."""
        if tensors is not None:
            laid, digest = laid_table(tensors, self.config.max_tensors)
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
            slot = self.memory.reserve(version, len(header) + total)
        except OSError as exc:
            raise ParamsError(ErrorCode.MEMORY_FULL, f"no room for version {version} ({len(header) + total} bytes) in "
                                             f"{self.config.shm_dir}: {exc}") from None
        os.pwrite(slot.fd, header, 0)
        push = PendingPush(uuid.uuid4().hex, version, laid, total, slot, len(header), dict(metadata), parts)
        self.pushes[version] = push
        log.info("push of version %d started: %d tensors, %d bytes, %d part(s)", version, len(laid), total, parts)
        return push

    def nixl_push_details(self, push: PendingPush) -> dict:
        """For a part pushed over NIXL: the push's slot registered with the PS's NIXL agent (once
        per push, until it commits or is dropped) and what the pusher needs to WRITE into it."""
        if self.nixl is None:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED, "NIXL is not enabled here; push the part over http")
        assert push.slot.mapping is not None
        details = self.nixl.push_details(push.push_id, int(np.frombuffer(push.slot.mapping, np.uint8).ctypes.data),
                                         push.data_offset, push.total_bytes)
        with self._cond:
            if self.pushes.get(push.version) is not push:  # dropped while it was being registered
                self.nixl.release_push(push.push_id)
                raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"the push of version {push.version} was dropped: {push.dropped}; push it again")
        return details

    def begin_push(self, version: int, tensors: Iterable[tuple[str, str, list[int]]], metadata: Mapping[str, str]) -> PendingPush:
        """A push by one pusher of the whole version (one part, chunks of ``chunk_bytes``)."""
        with self._cond:
            if version in self.pushes:
                push = self.pushes[version]
                raise ParamsError(ErrorCode.PUSH_IN_PROGRESS, f"a push of version {version} is in progress (push_id {push.push_id}); "
                                              "finish or abort it first")
        push, _ = self.join_push(version, 0, 1, tensors, metadata, None, "http")
        return push

    def _push(self, version: int, push_id: str) -> PendingPush:
        push = self.pushes.get(version)
        if push is None:
            state = "is complete" if version in self.versions else "has no push in progress"
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
            missing = [c.index for c in entry.chunks if c.index not in entry.received]
            if missing or entry.writing:
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                reason = f"chunks missing: {shown}" if missing else "chunks are still being received"
                raise ParamsError(ErrorCode.VERSION_INCOMPLETE, f"version {version} is incomplete "
                                              f"({len(entry.received)}/{len(entry.chunks)} chunks of part {part}): {reason}")
            entry.done = True
            push.last_active = time.monotonic()
            if len(push.parts) == push.expected_parts and all(p.done for p in push.parts.values()) and not push.committing:
                self._commit(push)  # waits for the lock again while it hashes
            deadline = time.monotonic() + wait_s
            while version not in self.versions and push.dropped is None and time.monotonic() < deadline:
                self._cond.wait(min(1.0, deadline - time.monotonic()))
            if push.dropped is not None and version not in self.versions:
                raise ParamsError(ErrorCode.UNKNOWN_PUSH, f"the push of version {version} was dropped: {push.dropped}; push it again")
            if version in self.versions:
                return {"version": version, "visible": True, **self.versions[version].summary()}
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
            landed = _hash_chunks(push.slot, push.data_offset, push.total_bytes, chunks,
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
        chunks = manifest_chunks(delivered, self.config.chunk_bytes)
        unhashed = [c for c in chunks if c.checksum is None]
        if unhashed:
            algorithm = next((checksum_algorithm(x) for _, x, _ in delivered if x is not None), checksum_algorithms()[0])
            self._cond.release()  # held once: finish_part takes it for this call alone
            try:
                sums = iter(_hash_chunks(push.slot, push.data_offset, push.total_bytes, unhashed,
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
            chunk_bytes=self.config.chunk_bytes, data_offset=push.data_offset, metadata=push.metadata,
            committed_at=time.time(),
        )
        push.slot.visible = True
        stored = StoredVersion(manifest, push.fd, push.data_offset + push.total_bytes, slot=push.slot,
                               visible_seconds=time.monotonic() - push.started, visible_at_monotonic=time.monotonic())
        del self.pushes[push.version]
        if self.nixl is not None:
            self.nixl.release_push(push.push_id)
        self.versions[push.version] = stored
        self.pushes_committed += 1
        if self.config.persist:
            self._to_persist.add(push.version)
        self._apply_retention()
        self._cond.notify_all()
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
            entry = self._part(push, 0)
            missing = [c.index for c in entry.chunks if c.index not in entry.received]
            if missing or entry.writing:
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                reason = f"chunks missing: {shown}" if missing else "chunks are still being received"
                raise ParamsError(ErrorCode.VERSION_INCOMPLETE, f"version {version} is incomplete "
                                              f"({len(entry.received)}/{len(entry.chunks)} chunks): {reason}")
        self.finish_part(version, push_id, 0)  # not under the lock: the commit lets it go while it hashes
        with self._cond:
            return self.versions[version].manifest

    def delete_version(self, version: int) -> StoredVersion:
        """Withdraw a complete version (a bad one, or to make room): no new pulls get it, and it
        leaves memory and disk once the pulls still reading it end."""
        with self._cond:
            stored = self.versions.get(version)
            if stored is None or not stored.retained:
                raise ParamsError(ErrorCode.UNKNOWN_VERSION, f"version {version} is not kept here")
            stored.retained = False
            self._to_persist.discard(version)
            if stored.leases == 0:
                self._destroy(stored)
            self._cond.notify_all()
            log.info("version %d deleted%s", version, f" once {stored.leases} reader(s) finish" if stored.leases else "")
            return stored

    def abort_push(self, version: int, push_id: str) -> None:
        with self._cond:
            push = self._push(version, push_id)
            if push.committing or push.writing:
                raise ParamsError(ErrorCode.BUSY, f"version {version} is being committed or received right now")
            self._drop_push(push, "aborted")
            self._cond.notify_all()

    def _drop_push(self, push: PendingPush, why: str) -> None:
        del self.pushes[push.version]
        push.dropped = why
        # a pusher that still writes through its own mapping (or NIXL) must not write into a reused slot
        if self.nixl is not None:
            self.nixl.release_push(push.push_id)
        self.memory.release(push.version, discard=any(p.via in ("shm", "nixl") for p in push.parts.values()))
        log.info("push of version %d dropped: %s", push.version, why)

    # -- persistence (off the critical path)

    def _disk_forever(self) -> None:
        """The disk work, off the critical path: persisting new versions, then deleting evicted ones."""
        while True:
            trash: Path | None = None
            with self._cond:
                while not self._to_persist and not self._trash and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                if self._to_persist:
                    version = max(self._to_persist)
                    self._to_persist.clear()  # older ones are superseded: recovery serves the newest
                    stored = self.versions.get(version)
                    if stored is None or stored.persisted:
                        continue
                    stored.leases += 1  # pinned: its slot is not reused while it is copied out
                else:
                    trash = self._trash.pop(0)
            if trash is not None:
                self._delete(trash)
                continue
            try:
                self._persist(stored)
            except OSError as exc:
                log.error("version %d was not persisted: %s", version, exc)
            finally:
                with self._cond:
                    stored.leases -= 1
                    if stored.leases == 0 and not stored.retained and version in self.versions:
                        self._destroy(stored)
                    self._cond.notify_all()

    def _persist(self, stored: StoredVersion) -> None:
        started = time.monotonic()
        version = stored.manifest.version
        directory = self.root / f".staging-v{version:010d}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        try:
            fd = os.open(directory / DATA_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                copied, budget = 0, self.config.persist_yield_s
                while copied < stored.file_size:
                    budget = self._yield_to_traffic(budget)
                    n = os.sendfile(fd, stored.fd, copied, min(PERSIST_STEP, stored.file_size - copied))
                    if n == 0:
                        raise OSError(f"version {version} ended at byte {copied} of {stored.file_size}")
                    copied += n
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            write_atomically(directory / MANIFEST_FILE, json.dumps(stored.manifest.to_json()).encode(), self.config.fsync)
            final = self.root / f"v{version:010d}"
            os.rename(directory, final)
            if self.config.fsync:
                fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        with self._cond:
            stored.directory, stored.persisted = final, True
            stored.persist_seconds = time.monotonic() - started
            stored.persist_yielded_seconds = self.config.persist_yield_s - budget
        log.info("version %d persisted in %.3f s (%.3f s of it yielding to pushes and pulls)", version,
                 stored.persist_seconds, stored.persist_yielded_seconds)

    def _delete(self, trash: Path) -> None:
        """Delete an evicted version's folder, its data file a step at a time: freeing a GB file
        takes ~0.2 s of kernel time, which a push or pull on the same cores would wait for."""
        budget = self.config.persist_yield_s
        try:
            with open(trash / DATA_FILE, "r+b") as data:
                size = os.fstat(data.fileno()).st_size
                while size > 0:
                    budget = self._yield_to_traffic(budget)
                    size = max(0, size - PERSIST_STEP)
                    os.ftruncate(data.fileno(), size)
        except OSError:
            pass  # already gone, or not a version folder: removed whole below
        shutil.rmtree(trash, ignore_errors=True)

    def _traffic(self) -> bool:
        """Pushes or pulls in flight: a persist competes with them for memory bandwidth and cores."""
        return bool(self.pushes) or bool(self.leases) or self.active_streams > 0

    def _yield_to_traffic(self, budget: float) -> float:
        """Wait while pushes or pulls are in flight, at most ``budget`` seconds; returns what is
        left of it (a PS that is never quiet still persists every version, ``budget`` later)."""
        if budget <= 0:
            return 0.0
        deadline = time.monotonic() + budget
        with self._cond:
            while self._traffic() and not self._closed and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
        return max(0.0, deadline - time.monotonic())

    def wait_persisted(self, version: int, timeout_s: float) -> bool:
        """True once ``version`` is on disk (tests, benchmarks, a clean stop)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                stored = self.versions.get(version)
                if stored is not None and stored.persisted:
                    return True
                if stored is None or time.monotonic() >= deadline:
                    return False
                self._cond.wait(min(1.0, deadline - time.monotonic()))

    # -- pull

    def _resolve(self, spec: str) -> tuple[int | None, str]:
        """(version or None, why not) for a version spec, among the retained versions."""
        kind, number = parse_version_spec(spec)
        retained = sorted(v for v, s in self.versions.items() if s.retained)
        if kind == "exact":
            version = number
        elif not retained:
            return None, "no complete version yet"
        else:
            version = retained[-1] - number
        stored = self.versions.get(version)
        if stored is not None and stored.retained:
            return version, ""
        if stored is not None or (retained and version < retained[0]):
            return None, f"version {version} is not kept any more (kept: {retained})"
        if version in self.pushes:
            return None, f"version {version} is being pushed"
        return None, f"version {version} has not been pushed (kept: {retained})"

    def acquire(self, spec: str, transport: str, wait_s: float = 0.0) -> tuple[Lease, StoredVersion]:
        """A lease on a complete version: it is not deleted until the lease ends. Waits up to
        ``wait_s`` for a version that is being pushed or not pushed yet."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                self._sweep()
                version, why = self._resolve(spec)
                if version is not None:
                    break
                kind, number = parse_version_spec(spec)
                newest = max(self.versions, default=-1)
                can_appear = (kind == "latest" and not self.versions) or (kind == "exact" and number > newest)
                remaining = deadline - time.monotonic()
                if not can_appear or remaining <= 0:
                    code = ErrorCode.VERSION_BEING_PUSHED if "being pushed" in why else ErrorCode.UNKNOWN_VERSION
                    hint = "; pass wait_s to wait for it" if can_appear else ""
                    raise ParamsError(code, why + hint)
                self._cond.wait(min(remaining, 1.0))
            stored = self.versions[version]
            stored.leases += 1
            lease = Lease(uuid.uuid4().hex, version, transport, time.monotonic() + self.config.lease_ttl_s)
            self.leases[lease.lease_id] = lease
            self.pulls_started[transport] = self.pulls_started.get(transport, 0) + 1
            return lease, stored

    def release(self, lease_id: str) -> bool:
        with self._cond:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unpin(lease.version)
            self._cond.notify_all()  # a persist may be waiting for the pulls to end
            return True

    def _unpin(self, version: int) -> None:
        stored = self.versions.get(version)
        if stored is None:
            return
        stored.leases -= 1
        if stored.leases == 0 and not stored.retained:
            self._destroy(stored)

    def _sweep(self) -> None:
        now = time.monotonic()
        for lease in [lease for lease in self.leases.values() if lease.expires_at < now]:
            log.warning("pull lease %s on version %d lapsed", lease.lease_id, lease.version)
            del self.leases[lease.lease_id]
            self._unpin(lease.version)
        for push in [p for p in self.pushes.values() if not p.writing and not p.committing
                     and now - p.last_active > self.config.push_ttl_s]:
            waiting = sorted(set(range(push.expected_parts)) - {i for i, p in push.parts.items() if p.done})
            self._drop_push(push, f"idle for {self.config.push_ttl_s:g} s waiting for part(s) {waiting}")
            self._cond.notify_all()

    def sweep(self) -> None:
        with self._cond:
            self._sweep()

    def open_range(self, version: int, lease_id: str | None) -> tuple[int, StoredVersion]:
        """A private fd (dup) on a stored version, for one stream, which pins the version until
        ``stream_done``. With a lease: renews it."""
        with self._cond:
            if lease_id is not None:
                lease = self.leases.get(lease_id)
                if lease is None:
                    raise ParamsError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id!r} is unknown or lapsed; open a new pull")
                if lease.version != version:
                    raise ParamsError(ErrorCode.LEASE_MISMATCH, f"lease {lease_id!r} is for version {lease.version}, not {version}")
                lease.expires_at = time.monotonic() + self.config.lease_ttl_s
            stored = self.versions.get(version)
            if stored is None:
                raise ParamsError(ErrorCode.UNKNOWN_VERSION, f"version {version} is not stored")
            self.active_streams += 1
            stored.leases += 1
            return os.dup(stored.fd), stored

    def stream_done(self, stored: StoredVersion) -> None:
        with self._cond:
            self.active_streams -= 1
            self._unpin(stored.manifest.version)
            self._cond.notify_all()

    def resolve_stored(self, spec: str) -> StoredVersion:
        with self._cond:
            version, why = self._resolve(spec)
            if version is None:
                raise ParamsError(ErrorCode.VERSION_BEING_PUSHED if "being pushed" in why else ErrorCode.UNKNOWN_VERSION, why)
            return self.versions[version]

    def memory_slot(self, stored: StoredVersion) -> ShmSlot:
        """The version's memory slot; a version recovered from disk is loaded into one first, and
        its chunks are checked against their checksums as they land there: shm pullers check only
        the slot's generation by default, so bytes enter a slot verified (as pushed bytes do)."""
        if stored.slot is not None:
            return stored.slot
        with self._loading:  # a second puller of the same version waits here; it never reads a half-loaded slot
            if stored.slot is not None:
                return stored.slot
            version = stored.manifest.version
            try:
                slot = self.memory.publish(version, stored.fd, stored.file_size)
            except (OSError, ValueError) as exc:
                raise ParamsError(ErrorCode.TRANSPORT_UNAVAILABLE,
                                  f"cannot load version {version} into shared memory: {exc}; pull over http") from None
            self._check_loaded(stored, slot)
            with self._cond:
                if stored.slot is None and version in self.versions:
                    assert slot.fd is not None
                    os.close(stored.fd)
                    stored.slot, stored.fd = slot, slot.fd
            return slot

    def _check_loaded(self, stored: StoredVersion, slot: ShmSlot) -> None:
        """Hash a version loaded from disk in its slot; a damaged one leaves no slot behind."""
        manifest = stored.manifest
        chunks = [c for c in manifest.chunks if c.checksum]
        landed = _hash_chunks(slot, manifest.data_offset, manifest.total_bytes, chunks,
                              [checksum_algorithm(c.checksum or "") for c in chunks], "params-load")
        damaged = [c.index for c, actual in zip(chunks, landed, strict=True) if actual != c.checksum]
        if damaged:
            self.memory.release(manifest.version, discard=True)
            raise ParamsError(ErrorCode.CHECKSUM_MISMATCH,
                              f"version {manifest.version} on disk does not match its checksums (chunks {damaged[:5]}): the "
                              f"persisted copy is damaged; delete it and push the version again")

    def metrics(self) -> list:
        """Prometheus view of the store, read at scrape time."""
        from staleflow import metrics as m

        with self._cond:
            retained = {v: s for v, s in self.versions.items() if s.retained}
            return [
                m.PARAMS_LATEST_VERSION.value(max(retained, default=-1)),
                m.PARAMS_VERSIONS.value(len(retained)),
                m.PARAMS_STORED_BYTES.value(sum(s.file_size for s in self.versions.values())),
                m.PARAMS_PUSHES.value(self.pushes_committed),
                m.PARAMS_PULLS.family([([t], n) for t, n in sorted(self.pulls_started.items())]),
                m.PARAMS_ACTIVE_PULLS.value(len(self.leases)),
            ]

    def describe(self) -> dict:
        with self._cond:
            self._sweep()
            return {
                "keep": self.config.keep,
                "latest": max((v for v, s in self.versions.items() if s.retained), default=None),
                "versions": [s.summary() for _, s in sorted(self.versions.items())],
                "pushes": [p.progress() for _, p in sorted(self.pushes.items())],
                "readers": {"leases": len(self.leases), "streams": self.active_streams},
                "writers": len(self.pushes),
                "transports": list(self.config.transports),
                "persist": self.config.persist,
                "shm": self.memory.usage(),
            }


def _hash_chunks(slot: ShmSlot, data_offset: int, total_bytes: int, chunks: Sequence[ChunkSpec],
                 algorithms: Sequence[str], thread_name: str) -> list[str]:
    """The checksums of ``chunks`` (gathered ones over their ranges in order) as they lie in
    ``slot``'s data section, hashed on a few threads (off the lock and the GIL)."""
    view = slot.view()[data_offset:data_offset + total_bytes]
    try:
        with ThreadPoolExecutor(min(default_workers(), max(1, len(chunks))), thread_name_prefix=thread_name) as pool:
            return list(chunk_checksums(ByteRegions.flat(view), chunks, algorithms, pool))
    finally:
        view.release()


