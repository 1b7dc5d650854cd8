"""The parameter server's REST app: wire models and ``create_app`` (endpoints: see docs/params.md)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

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
from staleflow.transports.http import CHECKSUM_HEADER, stream_file_range
from staleflow.transports.shm import host_id

log = logging.getLogger(__name__)


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
