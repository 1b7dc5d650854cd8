"""The parameter server's REST app: wire models and ``create_app`` (endpoints: see docs/params.md)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from staleflow.servers.params.config import ParamsConfig, ParamsError, TransportName
from staleflow.servers.params.store import ParamStore, StoredVersion
from staleflow.transports.base import (
    FormatError,
    checksum_algorithms,
)
from staleflow.transports.http import CHECKSUM_HEADER, stream_file_range, stream_mapped_range
from staleflow.transports.shm import host_id

log = logging.getLogger(__name__)


class TensorIn(BaseModel):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=64)


class PushBegin(BaseModel):
    tensors: list[TensorIn] = Field(min_length=1)
    metadata: dict[str, str] = Field(default_factory=dict)


class PartJoin(BaseModel):
    tensors: list[TensorIn] = Field(min_length=1, description="the whole version's tensor table, the same for every part")
    metadata: dict[str, str] = Field(default_factory=dict)
    parts: int = Field(ge=1, le=65536, description="how many parts the version is pushed in")
    ranges: list[tuple[int, int]] | None = Field(None, description="(offset, length) byte ranges of the data section "
                                                                     "this part delivers; absent: all of it")
    via: Literal["http", "shm"] = "http"


class PartDone(BaseModel):
    checksums: dict[int, str] | None = Field(None, description="chunk index -> checksum, for a part written over shm")
    wait_s: float = Field(0.0, ge=0, le=3600, description="wait this long for the other parts to finish")


class PullBegin(BaseModel):
    transport: TransportName = "http"
    wait_s: float = Field(0.0, ge=0, le=600, description="wait this long for a version that is not complete yet")


VersionSpec = Annotated[str, "a version number, 'latest' or 'latest-N'"]
STATUS_OF_CODE = {"invalid": 422, "not_found": 404, "conflict": 409, "too_large": 413, "unavailable": 503,
                  "client_gone": 400}


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
    app.state.body_limit_exempt = r"^/v1/params/[^/]+/(?:parts/[^/]+/)?chunks/"  # bounded per chunk (chunk_bytes) instead

    @app.exception_handler(ParamsError)
    async def _params_error(_: Request, exc: ParamsError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "code": exc.code}, status_code=STATUS_OF_CODE[exc.code])

    @app.exception_handler(FormatError)
    async def _format_error(_: Request, exc: FormatError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    def the_store(request: Request) -> ParamStore:
        return request.app.state.store

    @app.get("/v1/health")
    def health(request: Request) -> dict:
        s = the_store(request).describe()
        return {"status": "ok", "latest": s["latest"], "versions": len(s["versions"]),
                "transports": list(config.transports), "host_id": host_id()}

    @app.get("/v1/params")
    def list_versions(request: Request) -> dict:
        return the_store(request).describe()

    @app.get("/v1/params/latest")
    def latest(request: Request) -> dict:
        return the_store(request).resolve_stored("latest").manifest.summary()

    @app.post("/v1/params/{version}", status_code=201)
    def begin_push(request: Request, version: Annotated[int, "version number"], body: PushBegin) -> dict:
        if version < 0:
            raise ParamsError("invalid", "version must be >= 0")
        push = the_store(request).begin_push(version, [(t.name, t.dtype, t.shape) for t in body.tensors], body.metadata)
        chunks = push.parts[0].chunks
        return {"push_id": push.push_id, "version": version, "chunk_bytes": config.chunk_bytes,
                "total_bytes": push.total_bytes,
                "chunks": [{"index": c.index, "offset": c.offset, "length": c.length} for c in chunks],
                "checksum_algorithms": checksum_algorithms()}

    @app.post("/v1/params/{version}/parts/{part}", status_code=201)
    def join_push(request: Request, version: int, part: int, body: PartJoin) -> dict:
        if version < 0:
            raise ParamsError("invalid", "version must be >= 0")
        s = the_store(request)
        if body.via == "shm" and "shm" not in config.transports:
            raise ParamsError("invalid", "shared memory is not enabled here; push the part over http")
        push, entry = s.join_push(version, part, body.parts, [(t.name, t.dtype, t.shape) for t in body.tensors],
                                  body.metadata, body.ranges, body.via)
        details = ({"path": str(push.slot.path), "size": push.slot.size, "data_offset": push.data_offset,
                    "host_id": host_id()} if body.via == "shm" else {})
        return {"push_id": push.push_id, "version": version, "part": part, "chunk_bytes": config.chunk_bytes,
                "total_bytes": push.total_bytes, "data_offset": push.data_offset, "details": details,
                "chunks": [{"index": c.index, "offset": c.offset, "length": c.length} for c in entry.chunks],
                "checksum_algorithms": checksum_algorithms()}

    @app.put("/v1/params/{version}/parts/{part}/chunks/{index}")
    async def put_part_chunk(request: Request, version: int, part: int, index: int, push_id: Annotated[str, Query()]) -> dict:
        return await _receive_chunk(request, version, index, push_id, part)

    @app.post("/v1/params/{version}/parts/{part}/done")
    def finish_part(request: Request, version: int, part: int, push_id: Annotated[str, Query()],
                    body: PartDone | None = None) -> dict:
        body = body or PartDone()
        return the_store(request).finish_part(version, push_id, part, body.checksums, body.wait_s)

    @app.put("/v1/params/{version}/chunks/{index}")
    async def put_chunk(request: Request, version: int, index: int, push_id: Annotated[str, Query()]) -> dict:
        return await _receive_chunk(request, version, index, push_id, 0)

    async def _receive_chunk(request: Request, version: int, index: int, push_id: str, part: int) -> dict:
        length = request.headers.get("content-length")
        writer = the_store(request).chunk_writer(version, push_id, index, request.headers.get(CHECKSUM_HEADER),
                                                 int(length) if length and length.isdigit() else None, part)
        try:
            async for piece in request.stream():
                writer.add(piece)
        except ClientDisconnect:
            writer.abandon()
            raise ParamsError("client_gone", f"the client went away in the middle of chunk {index}") from None
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

    @app.get("/v1/params/{version}/persisted")
    def persisted(request: Request, version: int, wait_s: Annotated[float, Query(ge=0, le=3600)] = 0.0) -> dict:
        """Whether ``version`` is on disk yet (waits up to ``wait_s`` for it)."""
        return {"version": version, "persisted": the_store(request).wait_persisted(version, wait_s)}

    @app.get("/v1/params/{version}/manifest")
    def manifest(request: Request, version: VersionSpec) -> dict:
        return the_store(request).resolve_stored(version).manifest.to_json()

    @app.post("/v1/params/{version}/pulls", status_code=201)
    def begin_pull(request: Request, version: VersionSpec, body: PullBegin | None = None) -> dict:
        body = body or PullBegin()
        if body.transport not in config.transports:
            raise ParamsError("invalid", f"transport {body.transport!r} is not enabled here (enabled: {', '.join(config.transports)})")
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
            raise ParamsError("not_found", f"lease {lease_id!r} is unknown or lapsed")
        return {"lease_id": lease_id, "released": True}

    @app.get("/v1/params/{version}/chunks/{index}")
    def get_chunk(request: Request, version: int, index: int, lease: str | None = None) -> StreamingResponse:
        s = the_store(request)
        fd, stored = s.open_range(version, lease)
        chunks = stored.manifest.chunks
        if not 0 <= index < len(chunks):
            os.close(fd)
            s.stream_done(stored)
            raise ParamsError("not_found", f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
        chunk = chunks[index]
        return _stream(s, stored, fd, stored.manifest.data_offset + chunk.offset, chunk.length,
                       {CHECKSUM_HEADER: chunk.checksum or ""})

    @app.get("/v1/params/{version}/file")
    def get_file(request: Request, version: VersionSpec) -> StreamingResponse:
        """The whole version as one safetensors file (curl, engines that load a path)."""
        s = the_store(request)
        fd, stored = s.open_range(s.resolve_stored(version).manifest.version, None)
        return _stream(s, stored, fd, 0, stored.file_size,
                       {"content-disposition": f'attachment; filename="v{stored.manifest.version}.safetensors"'})

    return app


def _stream(store: ParamStore, stored: StoredVersion, fd: int, offset: int, length: int,
            headers: dict[str, str]) -> StreamingResponse:
    """A byte range of a stored version; from its memory slot's mapping when it has one (a copy
    at memory speed; pread from tmpfs is several times slower here), else from its file."""
    slot = stored.slot

    async def body() -> AsyncIterator[bytes]:
        try:
            if slot is not None and slot.mapping is not None:
                async for piece in stream_mapped_range(slot.mapping, offset, length):
                    yield piece
            else:
                async for piece in stream_file_range(fd, offset, length):
                    yield piece
        finally:
            os.close(fd)
            store.stream_done(stored)

    return StreamingResponse(body(), headers={"content-length": str(length), **headers},
                             media_type="application/octet-stream")


def _transport_details(store: ParamStore, stored: StoredVersion, transport: str) -> dict:
    version = stored.manifest.version
    if transport == "shm":
        slot = store.memory_slot(stored)  # a version recovered from disk is loaded on demand
        return {"path": str(slot.path), "size": slot.size, "host_id": host_id()}
    if transport == "nixl":
        assert store.nixl is not None
        return store.nixl.lease_details(version, stored.fd, stored.file_size)
    return {}


async def _sweep_forever(store: ParamStore, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        await asyncio.to_thread(store.sweep)
