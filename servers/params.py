"""The parameter server (PS): versioned model parameters between the trainer and the rollout
instances (paper §5.1, Figure 6 steps 4-5; Appendix A).

The trainer Pushes version v after each step; instances Pull the version the coordinator names.
Every version is immutable once committed, so the paper's read-write rule becomes:

* a version is written by exactly one Push and becomes visible atomically at its commit; a Pull
  of a version still being pushed waits for the commit (``wait_s``) or is refused, never served
  half-written bytes;
* Pulls share: any number of leases on a version at once;
* eviction is the other exclusive writer: a version outside the newest ``keep`` takes no new
  leases and is deleted only when its last lease is released (or expires).

Durability: a version lives in ``state_dir/versions/vNNNNNNNNNN/`` as one safetensors file plus
``manifest.json``, written last and renamed into place; a push in progress lives in a
``.staging-*`` folder that a restart discards. Data is served with pread from the stored file (or
from shared memory), so the PS's own memory stays bounded by a few pieces per stream.

Endpoints (JSON errors ``{"detail": ...}``): see docs/params.md.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import numpy as np
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, Field, model_validator

from staleflow.config import ServiceConfig
from staleflow.servers.clients import RestClient, ServiceError
from staleflow.servers.transports.base import (
    ByteRegions,
    ChecksumMismatch,
    ChunkHasher,
    ChunkSpec,
    FormatError,
    Manifest,
    PullLease,
    PushSession,
    TensorSpec,
    Transport,
    checksum_algorithm,
    checksum_algorithms,
    layout_tensors,
    numpy_dtype,
    parse_safetensors_header,
    plan_chunks,
    safetensors_dtype,
    safetensors_header,
)
from staleflow.servers.transports.http import CHECKSUM_HEADER, HttpTransport, stream_file_range
from staleflow.servers.transports.shm import ShmSlots, ShmTransport, host_id

__all__ = ["ParamStore", "ParamsClient", "ParamsConfig", "ParamsError", "RawTensor", "ServiceError", "create_app"]

log = logging.getLogger(__name__)

TransportName = Literal["http", "shm", "nixl"]
DATA_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{10})$")
_VERSION_SPEC = re.compile(r"^(?:(\d{1,18})|latest(?:-(\d{1,18}))?)$")


class ParamsConfig(ServiceConfig):
    port: int = Field(8331, ge=0, le=65535)
    state_dir: Path = Field(Path(".staleflow/params"), description="where complete versions are stored")
    keep: int = Field(2, ge=1, le=10_000, description="complete versions kept: the newest K")
    chunk_bytes: int = Field(64 << 20, ge=4096, le=1 << 30, description="bytes per chunk (the per-request payload limit)")
    transports: tuple[TransportName, ...] = Field(("http", "shm"), description="pull transports offered; http is always on")
    shm_dir: Path = Field(Path("/dev/shm"), description="where shared-memory segments live")
    lease_ttl_s: float = Field(120.0, gt=0, description="a pull lease lapses after this long without use")
    push_ttl_s: float = Field(900.0, gt=0, description="an idle unfinished push is dropped after this long")
    fsync: bool = Field(True, description="fsync a version before it becomes visible "
                                          "(off: faster, survives process crashes but not power loss)")
    max_tensors: int = Field(200_000, ge=1)

    @model_validator(mode="after")
    def _http_always(self) -> ParamsConfig:
        if "http" not in self.transports:
            raise ValueError("transports must include 'http': pushes and the chunk API always go over HTTP")
        if len(set(self.transports)) != len(self.transports):
            raise ValueError("transports lists a transport twice")
        return self


class ParamsError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


# ---------------------------------------------------------------- pure rules


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
            from staleflow.servers.transports.nixl import NixlExporter

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


# ---------------------------------------------------------------- REST


class TensorIn(BaseModel):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=64)


class PushBegin(BaseModel):
    tensors: list[TensorIn] = Field(min_length=1)
    metadata: dict[str, str] = Field(default_factory=dict)


class PullBegin(BaseModel):
    transport: TransportName = "http"
    wait_s: float = Field(0.0, ge=0, le=600, description="wait this long for a version that is not complete yet")


VersionSpec = Annotated[str, "a version number, 'latest' or 'latest-N'"]


def create_app(config: ParamsConfig, store: ParamStore | None = None, owns_store: bool | None = None) -> FastAPI:
    """The parameter server. Closes the store at shutdown if it opened it, or if ``owns_store``
    (uvicorn ends the process with the stop signal itself after a graceful shutdown, so code
    after ``serve_forever`` may never run)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = store is None if owns_store is None else owns_store
        app.state.store = store or await asyncio.to_thread(ParamStore, config)
        sweeper = asyncio.create_task(_sweep_forever(app.state.store, min(config.lease_ttl_s, config.push_ttl_s) / 4))
        log.info("parameter server ready: state=%s keep=%d transports=%s", config.state_dir, config.keep,
                 ",".join(config.transports))
        try:
            yield
        finally:
            sweeper.cancel()
            if owned:
                app.state.store.close()

    app = FastAPI(title="StaleFlow parameter server", version="1", lifespan=lifespan)
    app.state.body_limit_exempt = r"^/v1/params/[^/]+/chunks/"  # bounded per chunk (chunk_bytes) instead

    @app.exception_handler(ParamsError)
    async def _params_error(_: Request, exc: ParamsError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(FormatError)
    async def _format_error(_: Request, exc: FormatError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    def the_store(request: Request) -> ParamStore:
        return request.app.state.store

    @app.get("/v1/health")
    def health(request: Request) -> dict:
        s = the_store(request).describe()
        return {"status": "ok", "latest": s["latest"], "versions": len(s["versions"])}

    @app.get("/v1/params")
    def list_versions(request: Request) -> dict:
        return the_store(request).describe()

    @app.get("/v1/params/latest")
    def latest(request: Request) -> dict:
        return the_store(request).resolve_stored("latest").manifest.summary()

    @app.post("/v1/params/{version}", status_code=201)
    def begin_push(request: Request, version: Annotated[int, "version number"], body: PushBegin) -> dict:
        if version < 0:
            raise ParamsError(422, "version must be >= 0")
        push = the_store(request).begin_push(version, [(t.name, t.dtype, t.shape) for t in body.tensors], body.metadata)
        return {"push_id": push.push_id, "version": version, "chunk_bytes": config.chunk_bytes,
                "total_bytes": sum(c.length for c in push.chunks),
                "chunks": [{"index": c.index, "offset": c.offset, "length": c.length} for c in push.chunks],
                "checksum_algorithms": checksum_algorithms()}

    @app.put("/v1/params/{version}/chunks/{index}")
    async def put_chunk(request: Request, version: int, index: int, push_id: Annotated[str, Query()]) -> dict:
        length = request.headers.get("content-length")
        writer = the_store(request).chunk_writer(version, push_id, index, request.headers.get(CHECKSUM_HEADER),
                                                 int(length) if length and length.isdigit() else None)
        try:
            async for piece in request.stream():
                if writer.add(piece):
                    await asyncio.to_thread(writer.flush)
            await asyncio.to_thread(writer.flush)
        except ClientDisconnect:
            writer.abandon()
            raise ParamsError(400, f"the client went away in the middle of chunk {index}") from None
        except BaseException:
            writer.abandon()
            raise
        return {"index": index, "checksum": writer.finish()}

    @app.post("/v1/params/{version}/commit")
    def commit(request: Request, version: int, push_id: Annotated[str, Query()]) -> dict:
        return the_store(request).commit(version, push_id).summary()

    @app.delete("/v1/params/{version}/push")
    def abort_push(request: Request, version: int, push_id: Annotated[str, Query()]) -> dict:
        the_store(request).abort_push(version, push_id)
        return {"version": version, "aborted": True}

    @app.get("/v1/params/{version}/manifest")
    def manifest(request: Request, version: VersionSpec) -> dict:
        return the_store(request).resolve_stored(version).manifest.to_json()

    @app.post("/v1/params/{version}/pulls", status_code=201)
    def begin_pull(request: Request, version: VersionSpec, body: PullBegin | None = None) -> dict:
        body = body or PullBegin()
        if body.transport not in config.transports:
            raise ParamsError(422, f"transport {body.transport!r} is not enabled here (enabled: {', '.join(config.transports)})")
        s = the_store(request)
        lease, stored = s.acquire(version, body.transport, body.wait_s)
        try:
            details = _transport_details(s, stored, body.transport)
        except Exception:
            s.release(lease.lease_id)
            raise
        return {"lease_id": lease.lease_id, "version": lease.version, "transport": body.transport,
                "ttl_s": config.lease_ttl_s, "details": details, "manifest": stored.manifest.to_json()}

    @app.delete("/v1/pulls/{lease_id}")
    def end_pull(request: Request, lease_id: str) -> dict:
        if not the_store(request).release(lease_id):
            raise ParamsError(404, f"lease {lease_id!r} is unknown or lapsed")
        return {"lease_id": lease_id, "released": True}

    @app.get("/v1/params/{version}/chunks/{index}")
    def get_chunk(request: Request, version: int, index: int, lease: str | None = None) -> StreamingResponse:
        s = the_store(request)
        fd, stored = s.open_range(version, lease)
        chunks = stored.manifest.chunks
        if not 0 <= index < len(chunks):
            os.close(fd)
            s.stream_done()
            raise ParamsError(404, f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
        chunk = chunks[index]
        return _stream(s, fd, stored.manifest.data_offset + chunk.offset, chunk.length,
                       {CHECKSUM_HEADER: chunk.checksum or ""})

    @app.get("/v1/params/{version}/file")
    def get_file(request: Request, version: VersionSpec) -> StreamingResponse:
        """The whole version as one safetensors file (curl, engines that load a path)."""
        s = the_store(request)
        fd, stored = s.open_range(s.resolve_stored(version).manifest.version, None)
        return _stream(s, fd, 0, stored.file_size,
                       {"content-disposition": f'attachment; filename="v{stored.manifest.version}.safetensors"'})

    return app


def _stream(store: ParamStore, fd: int, offset: int, length: int, headers: dict[str, str]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for piece in stream_file_range(fd, offset, length):
                yield piece
        finally:
            os.close(fd)
            store.stream_done()

    return StreamingResponse(body(), headers={"content-length": str(length), **headers},
                             media_type="application/octet-stream")


def _transport_details(store: ParamStore, stored: StoredVersion, transport: str) -> dict:
    version = stored.manifest.version
    if transport == "shm":
        assert store.shm is not None
        slot = store.shm.slot_of(version)
        if slot is None:  # e.g. loaded from disk after a restart
            try:
                slot = store.shm.publish(version, stored.fd, stored.file_size)
            except OSError as exc:
                raise ParamsError(503, f"cannot publish version {version} to shared memory: {exc}; pull over http") from None
        return {"path": str(slot.path), "size": slot.size, "host_id": host_id()}
    if transport == "nixl":
        assert store.nixl is not None
        return store.nixl.lease_details(version, stored.fd, stored.file_size)
    return {}


async def _sweep_forever(store: ParamStore, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        await asyncio.to_thread(store.sweep)


# ---------------------------------------------------------------- client


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as raw bytes, for dtypes the caller has no array type for (e.g. BF16)."""

    dtype: str
    shape: tuple[int, ...]
    data: Any  # any buffer: bytes, bytearray, memoryview, numpy array


def _as_bytes(value: Any) -> tuple[str, tuple[int, ...], Any]:
    """(safetensors dtype, shape, a buffer holding the bytes) for numpy arrays, torch tensors and
    RawTensor; no copy for contiguous CPU data."""
    if isinstance(value, RawTensor):
        return value.dtype, tuple(value.shape), value.data
    if type(value).__module__.startswith("torch"):
        return _torch_bytes(value)
    array = np.asarray(value)
    return safetensors_dtype(array.dtype), array.shape, np.ascontiguousarray(array)


_TORCH_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64"}


def _torch_bytes(tensor: Any) -> tuple[str, tuple[int, ...], Any]:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise FormatError(f"torch dtype {tensor.dtype} has no safetensors equivalent")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return _TORCH_DTYPES[name], tuple(tensor.shape), flat.view(torch.uint8).numpy()


def _as_torch(array: np.ndarray, spec: TensorSpec) -> Any:
    import torch

    dtype = getattr(torch, {v: k for k, v in _TORCH_DTYPES.items()}[spec.dtype])
    raw = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return raw.view(dtype).reshape(spec.shape)


class ParamsClient(RestClient):
    """The parameter server's API for the trainer (push), the instances (pull) and the coordinator
    (versions, latest). Not thread-safe: one per thread. ``token`` (default: $STALEFLOW_TOKEN) is
    sent with every request, as the services' bearer-token check wants it for pushes."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None):
        super().__init__(url, token, timeout)
        self.url = url
        self.timeout = timeout
        self._transports: dict[str, Transport] = {}

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        super().close()

    def transport(self, name: str) -> Transport:
        if name not in self._transports:
            if name == "http":
                auth = {"Authorization": self.http.headers["authorization"]} if "authorization" in self.http.headers else {}
                self._transports[name] = HttpTransport(self.url, self.timeout, auth)
            elif name == "shm":
                self._transports[name] = ShmTransport()
            elif name == "nixl":
                from staleflow.servers.transports.nixl import NixlTransport

                self._transports[name] = NixlTransport()
            else:
                raise ValueError(f"unknown transport {name!r}: use http, shm or nixl")
        return self._transports[name]

    # -- queries

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def versions(self) -> dict:
        return self._call("GET", "/v1/params")

    def latest(self) -> dict:
        return self._call("GET", "/v1/params/latest")

    def manifest(self, version: int | str = "latest") -> Manifest:
        return Manifest.from_json(self._call("GET", f"/v1/params/{version}/manifest"))

    # -- push (trainer)

    def push(self, version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
             metadata: Mapping[str, str] | None = None) -> dict:
        """Store ``tensors`` (numpy arrays, torch tensors or RawTensor) as ``version``; returns
        the committed version's summary. The bytes are sent from the caller's buffers in chunks,
        never copied whole."""
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        converted = [(name, *_as_bytes(value)) for name, value in items]
        begin = self._call("POST", f"/v1/params/{version}", json={
            "tensors": [{"name": n, "dtype": d, "shape": list(s)} for n, d, s, _ in converted],
            "metadata": dict(metadata or {}),
        })
        laid = layout_tensors([(n, d, s) for n, d, s, _ in converted])
        source = ByteRegions.per_tensor(laid, {n: buf for n, _, _, buf in converted})
        algorithm = next(a for a in begin["checksum_algorithms"] + ["crc32"] if a in checksum_algorithms())
        session = PushSession(begin["push_id"], version, tuple(ChunkSpec.from_json(c) for c in begin["chunks"]), algorithm)
        try:
            self.transport("http").push(session, source)
            return self._call("POST", f"/v1/params/{version}/commit", params={"push_id": session.push_id})
        except BaseException:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"/v1/params/{version}/push", params={"push_id": session.push_id})
            raise

    # -- pull (instances)

    def open_pull(self, version: int | str = "latest", transport: str = "http", wait_s: float = 0.0) -> PullLease:
        body = self._call("POST", f"/v1/params/{version}/pulls", json={"transport": transport, "wait_s": wait_s},
                          timeout=self.timeout + wait_s)
        return PullLease(body["lease_id"], Manifest.from_json(body["manifest"]), body["transport"],
                         body["details"], body["ttl_s"])

    def close_pull(self, lease: PullLease) -> None:
        with contextlib.suppress(httpx.HTTPError):  # else the lease lapses on its own
            self.http.delete(f"/v1/pulls/{lease.lease_id}")

    def _open_auto(self, version: int | str, wait_s: float) -> PullLease:
        """shm when the PS offers it and runs on this host, else http."""
        try:
            lease = self.open_pull(version, "shm", wait_s)
        except ServiceError as exc:
            if exc.status != 422:  # 422: shm not enabled there
                raise
        else:
            if lease.details.get("host_id") == host_id():
                return lease
            self.close_pull(lease)
        return self.open_pull(version, "http", wait_s)

    def iter_pull(self, version: int | str = "latest", transport: str = "http", *, out: Mapping[str, Any] | None = None,
                  as_torch: bool = False, verify: bool = True, wait_s: float = 0.0) -> Iterator[tuple[str, Any]]:
        """Yields (name, tensor) as each tensor's chunks have landed and been verified. Into
        ``out`` (name -> preallocated array of the right size) if given, else into one new buffer
        of the version's size. ``transport="auto"`` picks shm on the PS's host, http elsewhere."""
        lease = self._open_auto(version, wait_s) if transport == "auto" else self.open_pull(version, transport, wait_s)
        try:
            yield from self.receive(lease, out=out, as_torch=as_torch, verify=verify)
        finally:
            self.close_pull(lease)

    def pull(self, version: int | str = "latest", transport: str = "http", *, out: Mapping[str, Any] | None = None,
             as_torch: bool = False, verify: bool = True, wait_s: float = 0.0) -> dict[str, Any]:
        """The whole state dict of ``version`` (a number, 'latest' or 'latest-N')."""
        return dict(self.iter_pull(version, transport, out=out, as_torch=as_torch, verify=verify, wait_s=wait_s))

    def receive(self, lease: PullLease, *, out: Mapping[str, Any] | None = None, as_torch: bool = False,
                verify: bool = True) -> Iterator[tuple[str, Any]]:
        """The tensors of an open lease (see ``open_pull``), as ``iter_pull`` yields them."""
        manifest = lease.manifest
        if out is not None:
            arrays = {t.name: _writable_array(out, t) for t in manifest.tensors}
            into = ByteRegions.per_tensor(manifest.tensors, arrays)
        else:
            flat = np.empty(manifest.total_bytes, np.uint8)
            arrays = {t.name: _view_of(flat, t) for t in manifest.tensors}
            into = ByteRegions.flat(flat)
        pending = sorted(manifest.tensors, key=lambda t: t.offset + t.nbytes)
        next_tensor = 0
        for verified_end in _verified_prefixes(self.transport(lease.transport), lease, into, verify):
            while next_tensor < len(pending) and pending[next_tensor].offset + pending[next_tensor].nbytes <= verified_end:
                spec = pending[next_tensor]
                next_tensor += 1
                if out is not None:
                    yield spec.name, out[spec.name]
                else:
                    yield spec.name, _as_torch(arrays[spec.name], spec) if as_torch else arrays[spec.name]


def _verified_prefixes(transport: Transport, lease: PullLease, into: ByteRegions, verify: bool) -> Iterator[int]:
    """Runs the transport; yields the end of the data section verified so far after each chunk."""
    chunks = lease.manifest.chunks
    yield 0  # zero-size tensors at the front
    if not chunks:
        return
    index, landed = 0, 0
    hasher = ChunkHasher(checksum_algorithm(chunks[0].checksum)) if verify else None
    for offset, length in transport.pull(lease, into):
        chunk = chunks[index]
        if offset != chunk.offset + landed:
            raise FormatError(f"transport {transport.name} delivered byte {offset}, expected {chunk.offset + landed}")
        if hasher is not None:
            for view in into.views(offset, length):
                hasher.update(view)
        landed += length
        if landed == chunk.length:
            if hasher is not None:
                actual = hasher.hexdigest()
                if actual != chunk.checksum:
                    raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual)
            yield chunk.offset + chunk.length
            index, landed = index + 1, 0
            if hasher is not None and index < len(chunks):
                hasher = ChunkHasher(checksum_algorithm(chunks[index].checksum))
    if index != len(chunks):
        raise FormatError(f"transport {transport.name} stopped after {index} of {len(chunks)} chunks")


def _view_of(flat: np.ndarray, spec: TensorSpec) -> np.ndarray:
    dtype = numpy_dtype(spec.dtype)
    if spec.nbytes == 0:
        return np.empty(spec.shape, dtype)
    return flat[spec.offset:spec.offset + spec.nbytes].view(dtype).reshape(spec.shape)


def _writable_array(out: Mapping[str, Any], spec: TensorSpec) -> Any:
    if spec.name not in out:
        raise FormatError(f"out has no buffer for tensor {spec.name!r}")
    target = out[spec.name]
    if type(target).__module__.startswith("torch"):
        target = _torch_bytes_target(target)
    if not isinstance(target, np.ndarray) or not target.flags.writeable or not target.flags.c_contiguous:
        raise FormatError(f"out[{spec.name!r}] must be a writable C-contiguous numpy array or CPU torch tensor")
    nbytes = target.nbytes
    if nbytes != spec.nbytes:
        raise FormatError(f"out[{spec.name!r}] holds {nbytes} bytes; version has {spec.nbytes} ({spec.dtype} {list(spec.shape)})")
    return target


def _torch_bytes_target(tensor: Any) -> np.ndarray:
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise FormatError("out tensors must be contiguous CPU tensors")
    return tensor.reshape(-1).view(torch.uint8).numpy()
