"""The parameter server's durable store: immutable committed versions, pushes in progress, pull leases
and retention, plus the pure rules they follow (version specs, retention, shared-memory names).

Durability: a version lives in ``state_dir/versions/vNNNNNNNNNN/`` as one safetensors file plus
``manifest.json``, written last and renamed into place; a push in progress lives in a
``.staging-*`` folder that a restart discards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from staleflow.servers.params.config import ParamsConfig, ParamsError
from staleflow.transports.base import (
    ChunkHasher,
    ChunkSpec,
    FormatError,
    Manifest,
    TensorSpec,
    checksum_algorithm,
    layout_tensors,
    parse_safetensors_header,
    plan_chunks,
    safetensors_header,
)
from staleflow.transports.http import CHECKSUM_HEADER
from staleflow.transports.shm import ShmSlots

log = logging.getLogger(__name__)


DATA_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{10})$")
_VERSION_SPEC = re.compile(r"^(?:(\d{1,18})|latest(?:-(\d{1,18}))?)$")


def parse_version_spec(spec: str) -> tuple[str, int]:
    """``"42"`` -> ("exact", 42); ``"latest"`` -> ("latest", 0); ``"latest-2"`` -> ("latest", 2)."""
    match = _VERSION_SPEC.match(spec)
    if not match:
        raise ParamsError(422, f"version {spec!r} must be a number, 'latest' or 'latest-N'")
    if match.group(1) is not None:
        return "exact", int(match.group(1))
    return "latest", int(match.group(2) or 0)


def shm_prefix(state_dir: Path) -> str:
    """Shared-memory segment names of the PS on ``state_dir``: a restart on the same directory
    finds (and removes) what a killed predecessor left."""
    return "staleflow-ps-" + hashlib.blake2b(str(state_dir.resolve()).encode(), digest_size=6).hexdigest()


def versions_to_drop(committed: Iterable[int], keep: int) -> list[int]:
    """Retention: everything but the newest ``keep`` complete versions."""
    return sorted(committed)[:-keep] if keep > 0 else sorted(committed)


# ---------------------------------------------------------------- the store


@dataclass
class StoredVersion:
    manifest: Manifest
    directory: Path
    fd: int
    file_size: int
    leases: int = 0
    retained: bool = True  # False: beyond the newest K, deleted once ``leases`` reaches 0


@dataclass
class PendingPush:
    push_id: str
    version: int
    tensors: tuple[TensorSpec, ...]
    chunks: list[ChunkSpec]
    directory: Path
    fd: int
    data_offset: int
    metadata: dict[str, str]
    received: dict[int, str] = field(default_factory=dict)  # chunk index -> checksum
    writing: set[int] = field(default_factory=set)
    committing: bool = False
    last_active: float = field(default_factory=time.monotonic)

    def progress(self) -> dict:
        return {"version": self.version, "push_id": self.push_id, "chunks": len(self.chunks),
                "received_chunks": len(self.received),
                "received_bytes": sum(self.chunks[i].length for i in self.received),
                "writing": sorted(self.writing), "committing": self.committing}


@dataclass
class Lease:
    lease_id: str
    version: int
    transport: str
    expires_at: float


class ChunkWriter:
    """Receives one chunk of a push piece by piece: collects pieces, writes them at the chunk's
    offset in batches (``flush``, meant for a worker thread: a write can block on a congested
    disk) and checksums them."""

    FLUSH_BYTES = 4 << 20

    def __init__(self, store: ParamStore, push: PendingPush, chunk: ChunkSpec, claimed: str):
        self.store, self.push, self.chunk, self.claimed = store, push, chunk, claimed
        self.hasher = ChunkHasher(checksum_algorithm(claimed))
        self.pending = bytearray()
        self.written = 0

    def add(self, piece: bytes) -> bool:
        """Collect a piece; True when enough is pending to flush."""
        if self.written + len(self.pending) + len(piece) > self.chunk.length:
            raise ParamsError(413, f"chunk {self.chunk.index} is {self.chunk.length} bytes; the body is longer")
        self.pending += piece
        return len(self.pending) >= self.FLUSH_BYTES

    def flush(self) -> None:
        data, self.pending = self.pending, bytearray()
        os.pwrite(self.push.fd, data, self.push.data_offset + self.chunk.offset + self.written)
        self.hasher.update(data)
        self.written += len(data)

    def finish(self) -> str:
        actual = self.hasher.hexdigest()
        if self.written != self.chunk.length:
            self.store.chunk_done(self.push, self.chunk.index, None)
            raise ParamsError(422, f"chunk {self.chunk.index}: received {self.written} of {self.chunk.length} bytes")
        if actual != self.claimed:
            self.store.chunk_done(self.push, self.chunk.index, None)
            raise ParamsError(422, f"chunk {self.chunk.index}: bad checksum: the body hashes to {actual}, "
                                   f"the request claims {self.claimed}; the chunk was not stored, send it again")
        self.store.chunk_done(self.push, self.chunk.index, actual)
        return actual

    def abandon(self) -> None:
        self.store.chunk_done(self.push, self.chunk.index, None)


class ParamStore:
    """Durable versioned storage with leases. Thread-safe; metadata under one condition variable,
    bulk reads and writes outside it."""

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
        self.leases: dict[str, Lease] = {}
        self.active_streams = 0
        self._closed = False
        self._cond = threading.Condition()
        self.shm: ShmSlots | None = None
        if "shm" in config.transports:
            self.shm = ShmSlots(config.shm_dir, shm_prefix(config.state_dir))
        self.nixl = None
        if "nixl" in config.transports:
            from staleflow.transports.nixl import NixlExporter

            self.nixl = NixlExporter(f"staleflow-ps-{uuid.uuid4().hex[:8]}")
        self._recover()

    # -- startup and shutdown

    def _recover(self) -> None:
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):  # an unfinished push or a half-deleted version
                log.info("discarding %s", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            match = _VERSION_DIR.match(entry.name)
            if not match:
                continue
            try:
                stored = _load_version(entry, int(match.group(1)))
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
        self._closed = True
        with self._cond:
            for push in list(self.pushes.values()):
                self._drop_push(push)
            for stored in self.versions.values():
                os.close(stored.fd)
            self.versions.clear()
            self.leases.clear()
        if self.shm is not None:
            self.shm.close()
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
        os.close(stored.fd)  # streams in flight read through their own dup of it
        if self.shm is not None:
            self.shm.release(version)
        if self.nixl is not None:
            self.nixl.release(version)
        trash = self.root / f".trash-{stored.directory.name}-{uuid.uuid4().hex[:8]}"
        os.rename(stored.directory, trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("evicted version %d", version)

    # -- push

    def begin_push(self, version: int, tensors: Iterable[tuple[str, str, list[int]]], metadata: Mapping[str, str]) -> PendingPush:
        laid = tuple(layout_tensors(tensors, self.config.max_tensors))
        total = sum(t.nbytes for t in laid)
        header = safetensors_header(laid, {"format": "pt", **metadata, "staleflow_version": str(version)})
        with self._cond:
            self._sweep()
            if version in self.versions:
                raise ParamsError(409, f"version {version} already exists; versions are immutable, push a new number")
            if version in self.pushes:
                raise ParamsError(409, f"a push of version {version} is in progress (push_id {self.pushes[version].push_id}); "
                                       "finish or abort it first")
            newest = max(self.versions, default=None)
            if newest is not None and version < newest:
                raise ParamsError(409, f"version {version} is older than the newest complete version {newest}")
            push_id = uuid.uuid4().hex
            directory = self.root / f".staging-v{version:010d}-{push_id[:8]}"
            directory.mkdir()
            fd = os.open(directory / DATA_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.pwrite(fd, header, 0)
                os.ftruncate(fd, len(header) + total)
            except OSError:
                os.close(fd)
                shutil.rmtree(directory, ignore_errors=True)
                raise
            push = PendingPush(push_id, version, laid, plan_chunks(total, self.config.chunk_bytes), directory, fd,
                               len(header), dict(metadata))
            self.pushes[version] = push
            log.info("push of version %d started: %d tensors, %d bytes, %d chunks", version, len(laid), total, len(push.chunks))
            return push

    def _push(self, version: int, push_id: str) -> PendingPush:
        push = self.pushes.get(version)
        if push is None:
            state = "is complete" if version in self.versions else "has no push in progress"
            raise ParamsError(404, f"version {version} {state}; start one with POST /v1/params/{version}")
        if push.push_id != push_id:
            raise ParamsError(409, f"push_id {push_id!r} does not match the push of version {version} in progress")
        return push

    def chunk_writer(self, version: int, push_id: str, index: int, claimed: str | None, length: int | None) -> ChunkWriter:
        if claimed is None:
            raise ParamsError(422, f"header {CHECKSUM_HEADER} is missing: send 'xxh3_64:<hex>' or 'crc32:<hex>' of the chunk")
        try:
            checksum_algorithm(claimed)
        except FormatError as exc:
            raise ParamsError(422, str(exc)) from None
        with self._cond:
            push = self._push(version, push_id)
            if not 0 <= index < len(push.chunks):
                raise ParamsError(404, f"version {version} has chunks 0..{len(push.chunks) - 1}, not {index}")
            chunk = push.chunks[index]
            if length is not None and length != chunk.length:
                status = 413 if length > chunk.length else 422
                raise ParamsError(status, f"chunk {index} is {chunk.length} bytes; Content-Length says {length}")
            if index in push.writing or push.committing:
                raise ParamsError(409, f"chunk {index} of version {version} is being received or committed right now")
            push.writing.add(index)
            push.received.pop(index, None)
            push.last_active = time.monotonic()
        return ChunkWriter(self, push, chunk, claimed)

    def chunk_done(self, push: PendingPush, index: int, checksum: str | None) -> None:
        with self._cond:
            push.writing.discard(index)
            if checksum is not None:
                push.received[index] = checksum
            push.last_active = time.monotonic()

    def commit(self, version: int, push_id: str) -> Manifest:
        with self._cond:
            push = self._push(version, push_id)
            missing = [c.index for c in push.chunks if c.index not in push.received]
            if push.committing:
                raise ParamsError(409, f"version {version} is being committed already")
            if missing or push.writing:
                shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
                reason = f"chunks missing: {shown}" if missing else "chunks are still being received"
                raise ParamsError(409, f"version {version} is incomplete "
                                       f"({len(push.received)}/{len(push.chunks)} chunks): {reason}")
            push.committing = True
        manifest = Manifest(
            version=version, tensors=push.tensors,
            chunks=tuple(ChunkSpec(c.index, c.offset, c.length, push.received[c.index]) for c in push.chunks),
            chunk_bytes=self.config.chunk_bytes, data_offset=push.data_offset, metadata=push.metadata,
            committed_at=time.time(),
        )
        final = self.root / f"v{version:010d}"
        try:
            if self.config.fsync:
                os.fsync(push.fd)
            _write_atomically(push.directory / MANIFEST_FILE, json.dumps(manifest.to_json()).encode(), self.config.fsync)
            os.rename(push.directory, final)
            if self.config.fsync:
                _fsync_dir(self.root)
        except OSError:
            with self._cond:
                push.committing = False
            raise
        stored = StoredVersion(manifest, final, push.fd, push.data_offset + manifest.total_bytes)
        if self.shm is not None:
            try:
                self.shm.publish(version, stored.fd, stored.file_size)
            except OSError as exc:  # shm pulls of it will retry; http still serves it
                log.warning("version %d not published to shared memory: %s", version, exc)
        with self._cond:
            del self.pushes[version]
            self.versions[version] = stored
            self._apply_retention()
            self._cond.notify_all()
        log.info("version %d committed (%d bytes)", version, manifest.total_bytes)
        return manifest

    def abort_push(self, version: int, push_id: str) -> None:
        with self._cond:
            push = self._push(version, push_id)
            if push.committing or push.writing:
                raise ParamsError(409, f"version {version} is being committed or received right now")
            self._drop_push(push)
            self._cond.notify_all()

    def _drop_push(self, push: PendingPush) -> None:
        del self.pushes[push.version]
        os.close(push.fd)
        shutil.rmtree(push.directory, ignore_errors=True)

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
                    status = 409 if "being pushed" in why else 404
                    hint = "; pass wait_s to wait for it" if can_appear else ""
                    raise ParamsError(status, why + hint)
                self._cond.wait(min(remaining, 1.0))
            stored = self.versions[version]
            stored.leases += 1
            lease = Lease(uuid.uuid4().hex, version, transport, time.monotonic() + self.config.lease_ttl_s)
            self.leases[lease.lease_id] = lease
            return lease, stored

    def release(self, lease_id: str) -> bool:
        with self._cond:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self._end_lease(lease)
            return True

    def _end_lease(self, lease: Lease) -> None:
        stored = self.versions.get(lease.version)
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
            self._end_lease(lease)
        for push in [p for p in self.pushes.values() if not p.writing and not p.committing
                     and now - p.last_active > self.config.push_ttl_s]:
            log.warning("dropping the idle push of version %d", push.version)
            self._drop_push(push)

    def sweep(self) -> None:
        with self._cond:
            self._sweep()

    def open_range(self, version: int, lease_id: str | None) -> tuple[int, StoredVersion]:
        """A private fd (dup) on a stored version, for one stream. With a lease: renews it."""
        with self._cond:
            if lease_id is not None:
                lease = self.leases.get(lease_id)
                if lease is None:
                    raise ParamsError(404, f"lease {lease_id!r} is unknown or lapsed; open a new pull")
                if lease.version != version:
                    raise ParamsError(422, f"lease {lease_id!r} is for version {lease.version}, not {version}")
                lease.expires_at = time.monotonic() + self.config.lease_ttl_s
            stored = self.versions.get(version)
            if stored is None:
                raise ParamsError(404, f"version {version} is not stored")
            self.active_streams += 1
            return os.dup(stored.fd), stored

    def stream_done(self) -> None:
        with self._cond:
            self.active_streams -= 1

    def resolve_stored(self, spec: str) -> StoredVersion:
        with self._cond:
            version, why = self._resolve(spec)
            if version is None:
                raise ParamsError(409 if "being pushed" in why else 404, why)
            return self.versions[version]

    def describe(self) -> dict:
        with self._cond:
            self._sweep()
            return {
                "keep": self.config.keep,
                "latest": max((v for v, s in self.versions.items() if s.retained), default=None),
                "versions": [
                    {**s.manifest.summary(), "leases": s.leases, "retained": s.retained}
                    for _, s in sorted(self.versions.items())
                ],
                "pushes": [p.progress() for _, p in sorted(self.pushes.items())],
                "readers": {"leases": len(self.leases), "streams": self.active_streams},
                "writers": len(self.pushes),
                "transports": list(self.config.transports),
                "shm": self.shm.usage() if self.shm is not None else None,
            }


def _load_version(directory: Path, version: int) -> StoredVersion:
    """A stored version whose manifest, file size and safetensors header agree, else FormatError."""
    manifest = Manifest.from_json(json.loads((directory / MANIFEST_FILE).read_text()))
    expected = manifest.data_offset + manifest.total_bytes
    fd = os.open(directory / DATA_FILE, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if manifest.version != version or size != expected:
            raise FormatError(f"data file is {size} bytes, the manifest of version {manifest.version} says {expected}")
        data_offset, tensors, _ = parse_safetensors_header(os.pread(fd, manifest.data_offset, 0))
        if data_offset != manifest.data_offset or tuple(tensors) != tuple(sorted(manifest.tensors, key=lambda t: t.offset)):
            raise FormatError("the file's safetensors header disagrees with the manifest")
    except BaseException:
        os.close(fd)
        raise
    return StoredVersion(manifest, directory, fd, expected)


def _write_atomically(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.rename(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
