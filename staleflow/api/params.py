"""The parameter server's contract: its wire models and its routes. ``ParamsClient``
(``staleflow.transports.client``) executes them with the data-plane transports behind it;
``AsyncParamsClient`` is the JSON API alone, for callers on an event loop (the coordinator)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from staleflow.api.base import AsyncClient, Client, Route
from staleflow.config.params import TransportName


class TensorIn(BaseModel):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=64)


class PushBegin(BaseModel):
    tensors: list[TensorIn] = Field(min_length=1)
    metadata: dict[str, str] = Field(default_factory=dict)


class PartJoin(BaseModel):
    tensors: list[TensorIn] | None = Field(default=None, min_length=1, description="the whole version's tensor table, the same for "
                                                                         "every part (may be left out once ``table`` names it)")
    table: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description="the table's digest (``table`` of a join's answer): "
                                                                          "names a table this PS was sent before")
    metadata: dict[str, str] = Field(default_factory=dict)
    parts: int = Field(ge=1, le=65536, description="how many parts the version is pushed in")
    ranges: list[tuple[int, int]] | None = Field(default=None, description="(offset, length) byte ranges of the data section "
                                                                     "this part delivers; absent: all of it")
    via: Literal["http", "shm", "nixl"] = "http"
    gather: bool = Field(default=False, description="the pusher takes chunks that gather several of its small ranges "
                                            "(each such chunk lists its ranges)")


class PartDone(BaseModel):
    checksums: dict[int, str | list[str]] | None = Field(default=None, description="chunk index -> checksum, for a part written over "
                                                                          "shm or nixl (a gathered chunk: its checksum, or "
                                                                          "the list of its ranges' checksums)")
    wait_s: float = Field(default=0.0, ge=0, le=3600, description="wait this long for the other parts to finish")


class PullBegin(BaseModel):
    transport: TransportName = "http"
    wait_s: float = Field(default=0.0, ge=0, le=600, description="wait this long for a version that is not complete yet")


VersionSpec = Annotated[str, "a version number, 'latest' or 'latest-N'"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ParamsHealth(_Answer):
    status: str
    latest: int | None
    versions: int
    transports: list[str]
    host_id: str
    data_port: int | None = Field(description="the data plane's port (chunk bodies), on this server's host; "
                                              "null: chunks go through this port")
    data_plane_accept_failures: int = Field(default=0, description="times the data plane ran out of descriptors or memory "
                                                           "accepting a connection, and retried")
    egress_gbps: float | None = Field(default=None, description="this server's egress limit over the chunk bodies it "
                                                               "sends, Gbit/s; null: none")


class VersionSummary(_Answer):
    version: int
    total_bytes: int
    tensors: int
    chunks: int
    chunk_bytes: int
    committed_at: float | None


class StoredSummary(VersionSummary):
    leases: int
    retained: bool
    in_memory: bool = Field(description="the version is served from host memory")
    persisted: bool = Field(description="a copy is on disk (crash recovery)")
    persist_seconds: float | None = Field(description="persist start to on disk, seconds (off the critical path)")
    persist_yielded_seconds: float | None = Field(description="of which the persist waited for pushes and pulls to end")
    visible_seconds: float | None = Field(description="push start to visible, seconds")
    visible_at_monotonic: float | None


class PushProgress(_Answer):
    version: int
    push_id: str
    parts: int = Field(description="parts the version is pushed in (one per pushing rank)")
    parts_joined: list[int]
    parts_done: list[int]
    chunks: int
    received_chunks: int
    received_bytes: int
    total_bytes: int
    writing: list[tuple[int, int]] = Field(description="(part, chunk) being received")
    committing: bool


class StoreDescription(_Answer):
    keep: int
    latest: int | None
    versions: list[StoredSummary]
    referenced: list[int] = Field(default_factory=list[int], description="versions whose copy the PS dropped: its holders "
                                                                    "serve them (reference-oriented storage)")
    pushes: list[PushProgress]
    readers: dict[str, int]
    writers: int
    transports: list[str]
    persist: bool
    shm: dict[str, Any] | None


class ChunkOut(_Answer):
    index: int
    offset: int
    length: int
    checksum: str | None = None
    segments: list[int] | None = Field(default=None, description="lengths of the runs the chunk's checksum is made of: each run "
                                                         "hashed alone, the checksum the hash of theirs (absent: one run)")


class PushChunkOut(ChunkOut):
    ranges: list[tuple[int, int]] | None = Field(default=None, description="a gathered chunk's (offset, length) ranges of the "
                                                                   "data section, in order: its bytes, one after the other")


class TensorOut(_Answer):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class ManifestOut(_Answer):
    version: int
    total_bytes: int
    chunk_bytes: int
    data_offset: int
    metadata: dict[str, str]
    committed_at: float | None
    tensors: list[TensorOut]
    chunks: list[ChunkOut]


class PartVisible(StoredSummary):
    """The part is done and the version is visible (this part was the last, or the others
    finished within ``wait_s``)."""

    visible: Literal[True]


class PartPending(PushProgress):
    """The part is done; the version waits for the other parts."""

    visible: Literal[False]


PartFinished = PartVisible | PartPending


class PushStarted(_Answer):
    push_id: str
    version: int
    chunk_bytes: int
    total_bytes: int
    chunks: list[ChunkOut]
    checksum_algorithms: list[str]


class PartJoined(_Answer):
    push_id: str
    version: int
    part: int
    table: str = Field(description="the tensor table's digest: later joins may send it instead of the table")
    chunk_bytes: int
    total_bytes: int
    data_offset: int
    details: dict[str, Any] = Field(description="over shm: the memory slot to write into (path, size, offsets); "
                                                "over nixl: the PS's agent metadata, the slot's address and data offset")
    chunks: list[PushChunkOut]
    checksum_algorithms: list[str]


class Persisted(_Answer):
    version: int
    persisted: bool


class ChunkReceived(_Answer):
    index: int
    checksum: str


class VersionDeleted(_Answer):
    version: int
    deleted: bool = Field(description="gone now; false: it goes when its open pulls end")
    readers: int = Field(description="pulls still reading it")


class PushAborted(_Answer):
    version: int
    aborted: bool


class PullStarted(_Answer):
    lease_id: str
    version: int
    transport: str
    ttl_s: float
    details: dict[str, Any] = Field(description="what the transport needs: a shm path, NIXL descriptors, ...")
    manifest: ManifestOut


class PullEnded(_Answer):
    lease_id: str
    released: bool


class HolderBeat(BaseModel):
    url: str = Field(min_length=1, max_length=2048, description="where the holder serves chunks (its data plane)")
    host_id: str = Field(min_length=1, max_length=256, description="the holder's host (``/proc/sys/kernel/random/boot_id``)")
    zone: str = Field(default="", max_length=256, description="a rack or zone label: pullers in it are served from it first")
    spot: bool = Field(default=False, description="a spot (preemptible) holder: serves, never counts for retention")
    transports: list[str] = Field(default_factory=lambda: ["http"], max_length=8,
                                  description="what its data plane serves peers over (http always; shm, nixl)")
    holdings: dict[int, list[int] | None] = Field(default_factory=dict[int, list[int] | None],
                                                  description="version -> the chunk indices held (null: all of them)")


class HolderPublish(BaseModel):
    chunks: list[int] | None = Field(default=None, description="the chunk indices held (null: the whole version); "
                                                               "an empty list: pulling it (its place in the pipeline)")
    manifest: dict[str, Any] | None = Field(default=None, description="the version's manifest, for a reference server "
                                                                      "that does not know the version (it restarted)")


class SourcesAsk(BaseModel):
    puller: str = Field(min_length=1, max_length=256, description="the puller's id (a holder's id when it serves what it pulls)")
    chunk: int = Field(ge=0, description="the chunk index the puller fetches next")
    count: int = Field(default=1, ge=1, le=4096, description="the sources are for this many chunks from ``chunk`` on")
    host_id: str = Field(default="", max_length=256)
    zone: str = Field(default="", max_length=256)
    exclude: list[str] = Field(default_factory=list, max_length=4096, description="sources not to name (they failed this pull)")
    failed: list[str] = Field(default_factory=list, max_length=4096, description="holders a transfer from failed since the "
                                                                                 "last ask: suspect until their next heartbeat")
    held: list[int] | None = Field(default=None, description="a registered puller's chunks verified so far: it serves them "
                                                             "(pipeline replication)")


class ChunkSource(_Answer):
    holder_id: str = Field(description="a holder's id, or 'ps': the parameter server's own copy")
    url: str | None = Field(description="where to GET the chunk (a holder's data plane); null: the parameter server")
    has_chunk: bool = Field(description="false: a holder still pulling the version; it answers once the chunk lands")
    tier: str = Field(description="host, zone, other or ps")
    transports: list[str] = Field(default_factory=lambda: ["http"], description="what the source serves peers over "
                                                                                "(http always; shm, nixl)")


class ChunkSources(_Answer):
    version: int
    chunk: int
    sources: list[ChunkSource] = Field(description="best first; the first is assigned to the puller (its load)")


class HolderAck(_Answer):
    holder_id: str
    ttl_s: float = Field(description="the record lapses this long after the last heartbeat")
    missing: list[int] = Field(default_factory=list[int], description="versions held whole that the reference server has no "
                                                                 "manifest of: publish them with their manifest")


class HolderPulled(_Answer):
    version: int
    seconds: float
    fetched: dict[str, int] = Field(description="source -> chunks fetched from it")
    failures: int = Field(default=0, description="chunk fetches that failed and were retried from another source")
    via: dict[str, int] = Field(default_factory=dict[str, int], description="transport (http, shm, nixl) -> chunks read over it")


class Unpublished(_Answer):
    holder_id: str
    version: int
    unpublished: Literal[True]


class PullerReleased(_Answer):
    puller: str
    released: bool


class ReferenceDescription(_Answer):
    retain: int
    replicas: int
    holder_ttl_s: float
    retained: list[int]
    ps_copies: list[int]
    available: list[int]
    holders: list[dict[str, Any]]
    loads: dict[str, int]


class ParamsRoutes:
    """The parameter server's REST API. The chunk routes carry raw bytes: the data-plane
    transports fill in their paths (``url_path``) and send the bodies themselves."""

    health = Route("GET", "/v1/health", ParamsHealth)
    versions = Route("GET", "/v1/params", StoreDescription)
    latest = Route("GET", "/v1/params/latest", VersionSummary)
    manifest = Route("GET", "/v1/params/{version}/manifest", ManifestOut)
    begin_push = Route("POST", "/v1/params/{version}", PushStarted, body=PushBegin)
    join_part = Route("POST", "/v1/params/{version}/parts/{part}", PartJoined, body=PartJoin)
    finish_part: Route[PartVisible | PartPending] = Route("POST", "/v1/params/{version}/parts/{part}/done", PartFinished,
                                                          body=PartDone, query=("push_id",))
    commit = Route("POST", "/v1/params/{version}/commit", VersionSummary, query=("push_id",))
    delete_version = Route("DELETE", "/v1/params/{version}", VersionDeleted)
    abort_push = Route("DELETE", "/v1/params/{version}/push", PushAborted, query=("push_id",))
    persisted = Route("GET", "/v1/params/{version}/persisted", Persisted, query=("wait_s",))
    open_pull = Route("POST", "/v1/params/{version}/pulls", PullStarted, body=PullBegin)
    close_pull = Route("DELETE", "/v1/pulls/{lease_id}", PullEnded)
    put_chunk = Route("PUT", "/v1/params/{version}/chunks/{index}", ChunkReceived, query=("push_id",))
    put_part_chunk = Route("PUT", "/v1/params/{version}/parts/{part}/chunks/{index}", ChunkReceived,
                           query=("push_id",))
    chunk: Route[None] = Route("GET", "/v1/params/{version}/chunks/{index}", None, query=("lease",))
    file: Route[None] = Route("GET", "/v1/params/{version}/file", None)
    # reference-oriented storage: holders serve the versions they hold (docs/params.md)
    references = Route("GET", "/v1/ros", ReferenceDescription)
    reference_manifest = Route("GET", "/v1/ros/versions/{version}", ManifestOut)
    chunk_sources = Route("POST", "/v1/ros/versions/{version}/sources", ChunkSources, body=SourcesAsk)
    release_puller = Route("DELETE", "/v1/ros/pullers/{puller}", PullerReleased)
    heartbeat = Route("PUT", "/v1/ros/holders/{holder_id}", HolderAck, body=HolderBeat)
    publish = Route("PUT", "/v1/ros/holders/{holder_id}/versions/{version}", HolderAck, body=HolderPublish)
    unpublish = Route("DELETE", "/v1/ros/holders/{holder_id}/versions/{version}", Unpublished, query=("wait_s",))
    # on a parameter server that is a holder (``holder_of``): pull a version from its holders, drop one
    holder_pull = Route("POST", "/v1/ros/held/{version}", HolderPulled)
    holder_drop = Route("DELETE", "/v1/ros/held/{version}", VersionDeleted)


class PeerLease(_Answer):
    lease_id: str
    version: int
    transport: str
    ttl_s: float
    details: dict[str, Any] = Field(description="what the transport needs: the slot's path and stamp, NIXL's agent, ...")
    held: list[int] | None = Field(description="the chunks landed when the lease was granted (null: all of them; a holder "
                                               "still pulling the version serves the rest as they land)")


class PeerRoutes:
    """What a holder's data plane (only) serves its peers besides chunk bodies: a lease on its copy
    of a version for reading it over shm or nixl (a copy still being pulled included), and a chunk
    ``HEAD`` that answers once the chunk landed verified (header ``X-StaleFlow-Landed-Through``:
    the end of the run of landed chunks from it). Raw requests, no body."""

    open_lease = Route("POST", "/v1/params/{version}/peer-leases", PeerLease, query=("transport",))
    close_lease = Route("DELETE", "/v1/peer-leases/{lease_id}", PullEnded)
    chunk_landed: Route[None] = Route("HEAD", "/v1/params/{version}/chunks/{index}", None, query=("lease",))


class AsyncParamsClient(ParamsRoutes, AsyncClient):
    """The parameter server's JSON API, for callers on an event loop."""


class ParamsApiClient(ParamsRoutes, Client):
    """The parameter server's JSON API alone (no transports), for inspection and tooling."""
