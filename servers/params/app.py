"""The parameter server's REST app: ``create_app`` (endpoints: see docs/params.md; wire models:
``staleflow.api.params``)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from staleflow import metrics as m
from staleflow.api.base import ServiceError
from staleflow.api.params import (
    HolderBeat,
    HolderPublish,
    ParamsRoutes,
    PartDone,
    PartJoin,
    PullBegin,
    PushBegin,
    SourcesAsk,
    VersionSpec,
)
from staleflow.config import ParamsConfig
from staleflow.errors import ErrorCode
from staleflow.servers.http import ConnectionLimits, Owned, background, handles, service_app
from staleflow.servers.params.dataplane import ChunkDataPlane
from staleflow.servers.params.holders import HolderAgent, ReferenceServer, advertised_url
from staleflow.servers.params.rules import ParamsError, StoredVersion
from staleflow.servers.params.store import ParamStore
from staleflow.transports.checksums import checksum_algorithms
from staleflow.transports.egress import EgressLimiter
from staleflow.transports.http import CHECKSUM_HEADER, stream_file_range, stream_mapped_range
from staleflow.transports.shm import host_id

log = logging.getLogger(__name__)


def binary_body(description: str) -> dict:
    """The OpenAPI description of a 200 answer whose body is raw bytes."""
    return {200: {"description": description,
                  "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


async def the_store(request: Request) -> ParamStore:
    return request.app.state.store


StoreDep = Annotated[ParamStore, Depends(the_store)]


def create_app(config: ParamsConfig, store: ParamStore | None = None, owns_store: bool | None = None,
               limits: ConnectionLimits | None = None) -> FastAPI:
    """The parameter server. Closes the store at shutdown if it opened it, or if ``owns_store``
    (uvicorn ends the process with the stop signal itself after a graceful shutdown, so code
    after ``serve_forever`` may never run). ``limits``: the data plane's (the API port's are
    uvicorn's, given where the app is served)."""

    async def open_store() -> ParamStore:
        return await asyncio.to_thread(ParamStore, config)

    async def close_store(opened: ParamStore) -> None:
        opened.close()

    @asynccontextmanager
    async def running(app: FastAPI, serving: ParamStore) -> AsyncIterator[None]:
        async with background(_sweep_forever(serving, min(config.lease_ttl_s, config.push_ttl_s) / 4)):
            app.state.data_plane = (None if config.data_port is None else
                                    ChunkDataPlane(serving, config.host, config.data_port, getattr(app.state, "token", None),
                                                   limits, app.state.egress))
            app.state.references, app.state.holder = _reference_role(app, serving, config)
            try:
                yield
            finally:
                for role in (app.state.holder, app.state.references):
                    if role is not None:
                        role.close()
                if app.state.data_plane is not None:
                    app.state.data_plane.close()

    def ready(_: ParamStore) -> None:
        log.info("parameter server ready: state=%s keep=%d transports=%s", config.state_dir, config.keep,
                 ",".join(config.transports))

    app = service_app("StaleFlow parameter server",
                      Owned("store", open_store, close_store, given=store, owns=owns_store, running=running, ready=ready))
    app.state.egress = EgressLimiter.of_gbps(config.egress_gbps)  # one endpoint: the data plane and this port share it
    m.mount_metrics(app, "params", lambda: app.state.store.metrics() if hasattr(app.state, "store") else [])
    app.state.body_limit_exempt = r"^/v1/params/[^/]+/(?:parts/[^/]+/)?chunks/"  # bounded per chunk (chunk_bytes) instead

    @handles(app, ParamsRoutes.health)
    def health(store: StoreDep) -> dict:
        plane: ChunkDataPlane | None = app.state.data_plane
        if plane is not None and not plane.accepting:
            raise ParamsError(ErrorCode.TRANSPORT_UNAVAILABLE, f"the data plane on port {plane.port} stopped accepting "
                                                               "connections (its log says why); restart the parameter server")
        s = store.describe()
        return {"status": "ok", "latest": s["latest"], "versions": len(s["versions"]),
                "transports": list(config.transports), "host_id": host_id(),
                "data_port": plane.port if plane is not None else None,
                "data_plane_accept_failures": plane.accept_failures if plane is not None else 0,
                "egress_gbps": config.egress_gbps}

    _add_version_routes(app)
    _add_push_routes(app, config)
    _add_pull_routes(app, config)
    _add_reference_routes(app)
    return app


def _reference_role(app: FastAPI, store: ParamStore, config: ParamsConfig) -> tuple[ReferenceServer | None, HolderAgent | None]:
    """The job's parameter server is the reference server; one with ``holder_of`` is a holder."""
    token = getattr(app.state, "token", None)
    if config.holder_of is None:
        return ReferenceServer(store, config, token), None
    plane: ChunkDataPlane | None = app.state.data_plane
    if plane is None:
        raise ValueError("a holder serves chunks on its data plane: give it a data port (not null)")
    return None, HolderAgent(store, config, advertised_url(config.host, plane.port), token, follow=config.holder_follows)


def _references(app: FastAPI) -> ReferenceServer:
    references = app.state.references
    if references is None:
        raise ParamsError(ErrorCode.NOT_FOUND, "this parameter server is a holder, not the reference server: ask "
                                               f"{app.state.holder.config.holder_of}")
    return references


def _holder(app: FastAPI) -> HolderAgent:
    holder = app.state.holder
    if holder is None:
        raise ParamsError(ErrorCode.NOT_FOUND, "this parameter server is no holder (start it with holder_of)")
    return holder


def _add_reference_routes(app: FastAPI) -> None:
    """Reference-oriented storage: holders, sources, retention (on the reference server), and a
    holder's own pulls (on a holder)."""

    @handles(app, ParamsRoutes.references)
    def references() -> dict:
        return _references(app).describe()

    @handles(app, ParamsRoutes.reference_manifest)
    def reference_manifest(store: StoreDep, version: VersionSpec) -> dict:
        return store.resolve_manifest(version).to_json()

    @handles(app, ParamsRoutes.chunk_sources)
    def chunk_sources(version: int, body: SourcesAsk) -> dict:
        return _references(app).sources(version, body.puller, body.chunk, body.host_id, body.zone, body.exclude,
                                          body.failed, body.held, body.count)

    @handles(app, ParamsRoutes.release_puller)
    def release_puller(puller: str) -> dict:
        return _references(app).release(puller)

    @handles(app, ParamsRoutes.heartbeat)
    def heartbeat(holder_id: str, body: HolderBeat) -> dict:
        return _references(app).heartbeat(holder_id, body.url, body.host_id, body.zone, body.spot, body.holdings,
                                          body.transports)

    @handles(app, ParamsRoutes.publish)
    def publish(holder_id: str, version: int, body: HolderPublish) -> dict:
        return _references(app).publish(holder_id, version, body.chunks, body.manifest)

    @handles(app, ParamsRoutes.unpublish)
    def unpublish(holder_id: str, version: int, wait_s: Annotated[float, Query(ge=0, le=3600)] = 60.0) -> dict:
        return _references(app).unpublish(holder_id, version, wait_s)

    @handles(app, ParamsRoutes.holder_pull)
    def holder_pull(version: VersionSpec) -> dict:
        try:
            return _holder(app).pull(int(version) if version.isdigit() else version)
        except ServiceError as exc:  # the reference server's or a source's refusal, passed on with its code
            raise ParamsError(exc.code or ErrorCode.UPSTREAM_ERROR, f"pulling version {version} from its holders: "
                                                                    f"{exc.detail}") from None

    @handles(app, ParamsRoutes.holder_drop)
    def holder_drop(store: StoreDep, version: int) -> dict:
        _holder(app).unpublish(version)
        return {"version": version, "deleted": version not in store.versions, "readers": 0}


def _add_version_routes(app: FastAPI) -> None:
    """Listing, resolving and withdrawing versions."""

    @handles(app, ParamsRoutes.versions)
    def list_versions(store: StoreDep) -> dict:
        return store.describe()

    @handles(app, ParamsRoutes.latest)
    def latest(store: StoreDep) -> dict:
        return store.resolve_manifest("latest").summary()

    @handles(app, ParamsRoutes.delete_version)
    def delete_version(store: StoreDep, version: int) -> dict:
        """Withdraw a version: new pulls are refused at once; it is freed when its open pulls end.
        One only holders hold is withdrawn from the reference server (holders drop it as they pull on)."""
        if app.state.references is not None and app.state.references.withdraw(version):
            return {"version": version, "deleted": True, "readers": 0}
        stored = store.delete_version(version)
        if app.state.references is not None:
            app.state.references.deleted(version)
        return {"version": version, "deleted": stored.leases == 0, "readers": stored.leases}


def _add_push_routes(app: FastAPI, config: ParamsConfig) -> None:
    """Pushes: one pusher's (begin, chunks, commit) and in parts (join, chunks, done), and aborts."""

    @handles(app, ParamsRoutes.begin_push, status_code=201)
    def begin_push(store: StoreDep, version: Annotated[int, "version number"], body: PushBegin) -> dict:
        if version < 0:
            raise ParamsError(ErrorCode.INVALID_VERSION, "version must be >= 0")
        push = store.pushes.begin_push(version, [(t.name, t.dtype, t.shape) for t in body.tensors], body.metadata)
        chunks = push.parts[0].chunks
        return {"push_id": push.push_id, "version": version, "chunk_bytes": config.chunk_bytes,
                "total_bytes": push.total_bytes,
                "chunks": [{"index": c.index, "offset": c.offset, "length": c.length} for c in chunks],
                "checksum_algorithms": checksum_algorithms()}

    @handles(app, ParamsRoutes.join_part, status_code=201)
    def join_push(store: StoreDep, version: int, part: int, body: PartJoin) -> dict:
        if version < 0:
            raise ParamsError(ErrorCode.INVALID_VERSION, "version must be >= 0")
        if body.via == "shm" and "shm" not in config.transports:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED, "shared memory is not enabled here; push the part over http")
        if body.via == "nixl" and "nixl" not in config.transports:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED, "NIXL is not enabled here; push the part over http")
        tensors = None if body.tensors is None else [(t.name, t.dtype, t.shape) for t in body.tensors]
        push, entry = store.pushes.join_push(version, part, body.parts, tensors, body.metadata, body.ranges, body.via, body.gather,
                                      body.table)
        details = ({"path": str(push.slot.path), "size": push.slot.size, "data_offset": push.data_offset,
                    "host_id": host_id()} if body.via == "shm" else {})
        if body.via == "nixl":
            details = store.pushes.nixl_push_details(push)
        return {"push_id": push.push_id, "version": version, "part": part, "table": push.table, "chunk_bytes": config.chunk_bytes,
                "total_bytes": push.total_bytes, "data_offset": push.data_offset, "details": details,
                "chunks": [{"index": c.index, "offset": c.offset, "length": c.length, "ranges": c.ranges or None}
                           for c in entry.chunks],
                "checksum_algorithms": checksum_algorithms()}

    @handles(app, ParamsRoutes.put_part_chunk)
    async def put_part_chunk(request: Request, store: StoreDep, version: int, part: int, index: int,
                             push_id: Annotated[str, Query()]) -> dict:
        return await _receive_chunk(request, store, version, index, push_id, part)

    @handles(app, ParamsRoutes.finish_part)
    def finish_part(store: StoreDep, version: int, part: int, push_id: Annotated[str, Query()],
                    body: PartDone | None = None) -> dict:
        body = body or PartDone()
        return store.pushes.finish_part(version, push_id, part, body.checksums, body.wait_s)

    @handles(app, ParamsRoutes.put_chunk)
    async def put_chunk(request: Request, store: StoreDep, version: int, index: int,
                        push_id: Annotated[str, Query()]) -> dict:
        return await _receive_chunk(request, store, version, index, push_id, 0)

    @handles(app, ParamsRoutes.commit)
    def commit(store: StoreDep, version: int, push_id: Annotated[str, Query()]) -> dict:
        return store.pushes.commit(version, push_id).summary()

    @handles(app, ParamsRoutes.abort_push)
    def abort_push(store: StoreDep, version: int, push_id: Annotated[str, Query()]) -> dict:
        store.pushes.abort_push(version, push_id)
        return {"version": version, "aborted": True}


def _add_pull_routes(app: FastAPI, config: ParamsConfig) -> None:
    """Pulls: leases, chunks and whole files, and whether a version is on disk yet."""

    @handles(app, ParamsRoutes.persisted)
    def persisted(store: StoreDep, version: int, wait_s: Annotated[float, Query(ge=0, le=3600)] = 0.0) -> dict:
        """Whether ``version`` is on disk yet (waits up to ``wait_s`` for it)."""
        return {"version": version, "persisted": store.wait_persisted(version, wait_s)}

    @handles(app, ParamsRoutes.manifest)
    def manifest(store: StoreDep, version: VersionSpec) -> dict:
        return store.resolve_manifest(version).to_json()

    @handles(app, ParamsRoutes.open_pull, status_code=201)
    def begin_pull(s: StoreDep, version: VersionSpec, body: PullBegin | None = None) -> dict:
        body = body or PullBegin()
        if body.transport not in config.transports:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED,
                              f"transport {body.transport!r} is not enabled here (enabled: {', '.join(config.transports)})")
        holder: HolderAgent | None = app.state.holder
        if holder is not None and version.isdigit() and int(version) in holder.unavailable and int(version) not in s.versions:
            raise ParamsError(ErrorCode.VERSION_UNAVAILABLE, f"version {version} cannot be pulled here: nobody holds it any "
                                                             "more (the reference server said so); pull a version that exists")
        lease, stored = s.acquire(version, body.transport, body.wait_s)
        try:
            details = s.transport_details(stored, body.transport)
        except Exception:
            s.release(lease.lease_id)
            raise
        return {"lease_id": lease.lease_id, "version": lease.version, "transport": body.transport,
                "ttl_s": config.lease_ttl_s, "details": details, "manifest": stored.manifest.to_json()}

    @handles(app, ParamsRoutes.close_pull)
    def end_pull(store: StoreDep, lease_id: str) -> dict:
        if not store.release(lease_id):
            raise ParamsError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id!r} is unknown or lapsed")
        return {"lease_id": lease_id, "released": True}

    @handles(app, ParamsRoutes.chunk, response_class=StreamingResponse,
              responses=binary_body(f"the chunk's bytes; header {CHECKSUM_HEADER}: their checksum"))
    def get_chunk(s: StoreDep, version: int, index: int, lease: str | None = None) -> StreamingResponse:
        fd, stored = s.open_range(version, lease)
        chunks = stored.manifest.chunks
        if not 0 <= index < len(chunks):
            os.close(fd)
            s.stream_done(stored)
            raise ParamsError(ErrorCode.UNKNOWN_CHUNK, f"version {version} has chunks 0..{len(chunks) - 1}, not {index}")
        chunk = chunks[index]
        return _stream(s, stored, fd, stored.manifest.data_offset + chunk.offset, chunk.length,
                       {CHECKSUM_HEADER: chunk.checksum or ""}, app.state.egress)

    @handles(app, ParamsRoutes.file, response_class=StreamingResponse,
              responses=binary_body("the version as one safetensors file"))
    def get_file(s: StoreDep, version: VersionSpec) -> StreamingResponse:
        """The whole version as one safetensors file (curl, engines that load a path)."""
        fd, stored = s.open_range(s.resolve_stored(version).manifest.version, None)
        return _stream(s, stored, fd, 0, stored.file_size,
                       {"content-disposition": f'attachment; filename="v{stored.manifest.version}.safetensors"'},
                       app.state.egress)


async def _receive_chunk(request: Request, store: ParamStore, version: int, index: int, push_id: str,
                         part: int) -> dict:
    length = request.headers.get("content-length")
    writer = store.pushes.chunk_writer(version, push_id, index, request.headers.get(CHECKSUM_HEADER),
                                int(length) if length and length.isdigit() else None, part)
    try:
        async for piece in request.stream():
            writer.add(piece)
    except ClientDisconnect:
        writer.abandon()
        raise ParamsError(ErrorCode.CLIENT_DISCONNECTED, f"the client went away in the middle of chunk {index}") from None
    except BaseException:
        writer.abandon()
        raise
    return {"index": index, "checksum": writer.finish()}


def _stream(store: ParamStore, stored: StoredVersion, fd: int, offset: int, length: int,
            headers: dict[str, str], egress: EgressLimiter | None = None) -> StreamingResponse:
    """A byte range of a stored version; from its memory slot's mapping when it has one (a copy
    at memory speed; pread from tmpfs is several times slower here), else from its file; paced
    by the endpoint's ``egress`` when it has one."""
    slot = stored.slot

    async def body() -> AsyncIterator[bytes]:
        try:
            pieces = (stream_mapped_range(slot.mapping, offset, length) if slot is not None and slot.mapping is not None
                      else stream_file_range(fd, offset, length))
            async for piece in pieces if egress is None else egress.apieces(pieces):
                yield piece
        finally:
            os.close(fd)
            store.stream_done(stored)

    return StreamingResponse(body(), headers={"content-length": str(length), **headers},
                             media_type="application/octet-stream")


async def _sweep_forever(store: ParamStore, period: float) -> None:
    while True:
        await asyncio.sleep(period)
        await asyncio.to_thread(store.sweep)
