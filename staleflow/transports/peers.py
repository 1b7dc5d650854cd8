"""The ``ros`` transport: a version pulled chunk by chunk from the holders that hold it
(reference-oriented storage), each chunk from the source the reference server names, verified
against the version's checksums before it counts; a source that fails or sends a corrupt chunk is
excluded and the chunk is fetched again from the next one (never a corrupt byte handed out).

The sources come from ``ask(version, chunk, count, exclude, failed, held) -> [ChunkSource]`` (for
``count`` chunks from ``chunk`` on): for a client, the reference
server's ``chunk_sources`` route (``reference_sources``); for the parameter server taking a copy
back, a fixed list of holders. A holder pulling a version reports the chunks it holds so far in
each ask (``held``), and serves them meanwhile: a burst of pullers forms a chain.

Each holder is read over the transport ``peer_transport_for`` picks from the puller's choice
(``peers``; ``auto``: shm from a holder on this host, nixl where both offer it, http otherwise),
through a lease on the holder's copy (``peer_reads``); the parameter server's own copy over http.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from staleflow.api.base import Client, ServiceError
from staleflow.api.params import ChunkSource
from staleflow.api.params import ParamsRoutes as API
from staleflow.errors import ErrorCode
from staleflow.transports.base import PullLease, Transport
from staleflow.transports.checksums import verify_chunk
from staleflow.transports.errors import ChecksumMismatch, SlotReused, TransportUnavailable
from staleflow.transports.http import RawHttpConnection, raise_for_status
from staleflow.transports.layout import ChunkSpec, Manifest
from staleflow.transports.peer_reads import PeerCopy, check_peer_transport, nixl_here, peer_transport_for
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import ShmTransport

log = logging.getLogger(__name__)

Ask = Callable[[int, ChunkSpec, int, Sequence[str], Sequence[str], Sequence[int] | None], Sequence[ChunkSource]]
ASK_CHUNKS = 8
"""Chunks one ask names sources for: the asks' rate at the reference server (one Python service
for every puller) is this many times smaller than the chunks' (measured: at 4 MiB chunks and 1
Gbit/s, eight pullers asking for every chunk kept the reference server's two cores busy)."""
SOURCE_FAILURES = (OSError, ConnectionError, ServiceError, ChecksumMismatch, SlotReused, TransportUnavailable)
"""What a read from a source raises when that source failed (the chunk is fetched elsewhere)."""
SOURCE_RETRY_S = 30.0
"""How long a chunk is retried (asking for sources again) once every source named failed."""


def reference_sources(api: Client, puller: str, host_id: str, zone: str) -> Ask:
    """Sources from the reference server at ``api`` (its ``chunk_sources`` route)."""

    def ask(version: int, chunk: ChunkSpec, count: int, exclude: Sequence[str], failed: Sequence[str],
            held: Sequence[int] | None) -> list[ChunkSource]:
        reply = api.send(API.chunk_sources, API.chunk_sources.request(
            version, puller=puller, chunk=chunk.index, count=count, host_id=host_id, zone=zone, exclude=list(exclude),
            failed=list(failed), held=None if held is None else list(held)))
        return reply.sources

    return ask


class PeerTransport(Transport):
    """Pulls a lease's chunks from the sources ``ask`` names. ``ps_url``: where the parameter
    server's own copy is fetched (a source with no url); ``ps_url(True)`` asks it again (a restarted
    parameter server serves its data plane on another port). ``on_chunk(index)``: a chunk landed
    verified (a holder serves it from then on). ``report``: send the chunks held so far with each
    ask (a registered holder). ``peers``: how holders are read (``PEER_TRANSPORTS``; a lease's
    ``details["peers"]`` overrides it). Counts what it fetched from where (``fetched``), over
    which transport (``fetched_via``), and what failed."""

    name = "ros"

    def __init__(self, ask: Ask, ps_url: Callable[[bool], str] | None, timeout: float = 60.0,
                 headers: Mapping[str, str] | None = None, on_chunk: Callable[[int], None] | None = None,
                 report: bool = False, retry_s: float = SOURCE_RETRY_S, peers: str = "http"):
        self.ask, self.ps_url, self.timeout = ask, ps_url, timeout
        self.peers = check_peer_transport(peers)
        self.fetched_via: dict[str, int] = {}  # transport -> chunks read over it
        self._copies: dict[str, PeerCopy] = {}  # holder -> the lease on its copy, in this pull
        self._http_only: set[str] = set()  # holders whose copy cannot be read in memory from here (this pull)
        self._movers: dict[str, Any] = {}  # shm, nixl: their client transports, kept across pulls
        self._pull: tuple[Manifest, str, str] | None = None  # (manifest, peer choice, verify) of the pull running
        self.headers = dict(headers or {})
        self.on_chunk, self.report, self.retry_s = on_chunk, report, retry_s
        self._connections: dict[str, RawHttpConnection] = {}
        self.fetched: dict[str, int] = {}  # source -> chunks fetched from it
        self.failures: list[tuple[int, str, str]] = []  # (chunk, source, why)
        self.excluded: set[str] = set()  # sources that failed in this pull
        self.ask_chunks = ASK_CHUNKS
        self._urls: dict[str, str] = {}  # holder -> its data plane, for ending the lease on its copy
        self._unreported: list[str] = []
        self._ps_stale = False  # reading the PS's copy failed: look its data plane up again

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        """Each chunk as one range, once verified (``pull_verified`` is the checked path)."""
        starts = {c.offset + c.length: c.offset for c in lease.manifest.chunks}
        for end in self.pull_verified(lease, into):
            yield starts[end], end - starts[end]

    def pull_verified(self, lease: PullLease, into: ByteRegions, held: list[int] | None = None,
                      verify: str = "auto") -> Iterator[int]:
        """Fetches and verifies every chunk of the lease in order; yields the end of the data
        section verified so far. ``held``: chunks already held (reported to the reference).
        ``verify``: over shm, the slot's stamp (``auto``) or every byte hashed (``checksum``);
        every other way is hashed. The leases on holders' copies end with the pull."""
        self._pull = (lease.manifest, check_peer_transport(str(lease.details.get("peers", self.peers))),
                      "checksum" if verify == "checksum" else "auto")
        self._http_only.clear()
        try:
            yield from self._pull_chunks(lease, into, held)
        finally:
            self._end_copies()
            self._pull = None

    def _end_copies(self) -> None:
        for holder, copy in self._copies.items():
            copy.close(self._connections.get(self._urls.get(holder, "")))
        self._copies.clear()
        nixl = self._movers.get("nixl")
        if nixl is not None:
            nixl.forget_reads()

    def _pull_chunks(self, lease: PullLease, into: ByteRegions, held: list[int] | None) -> Iterator[int]:
        """The sources of the next run of chunks are asked for while this one is on the wire (the
        ask's round trip is then off the critical path)."""
        held = list(held or [])
        self.excluded.clear()
        version, chunks = lease.manifest.version, lease.manifest.chunks
        # consecutive chunks of the lease (a selected pull's lease lists some only), a run per ask
        runs = [chunks[i:i + self.ask_chunks] for i in range(0, len(chunks), self.ask_chunks)]
        with ThreadPoolExecutor(1, thread_name_prefix="ros-ask") as asker:
            upcoming: Future | None = asker.submit(self._ask, version, runs[0], held) if runs else None
            for position, run in enumerate(runs):
                assert upcoming is not None
                named = upcoming
                upcoming = (asker.submit(self._ask, version, runs[position + 1], list(held))
                            if position + 1 < len(runs) else None)
                try:
                    prefetched = named.result()
                except ServiceError:
                    prefetched = None  # asked again below, where a refusal is handled
                for chunk in run:
                    self._fetch(version, chunk, into, held, prefetched)
                    held.append(chunk.index)
                    if self.on_chunk is not None:
                        self.on_chunk(chunk.index)
                    yield chunk.offset + chunk.length

    def _ask(self, version: int, run: Sequence[ChunkSpec], held: Sequence[int]) -> Sequence[ChunkSource]:
        failed, self._unreported = self._unreported, []  # reported with the next ask, whichever thread sends it
        count = run[-1].index - run[0].index + 1
        return self.ask(version, run[0], count, sorted(self.excluded), failed, held if self.report else None)

    def _fetch(self, version: int, chunk: ChunkSpec, into: ByteRegions, held: Sequence[int],
               prefetched: Sequence[ChunkSource] | None = None) -> None:
        """One chunk, verified, from the first source that delivers it (``prefetched``: the
        sources named for it already). A source that failed is not asked again in this pull, and
        is reported once (the reference server stops naming it until its next heartbeat)."""
        exclude = self.excluded
        deadline = time.monotonic() + self.retry_s
        while True:
            if prefetched is not None:
                sources, prefetched = [s for s in prefetched if s.holder_id not in exclude], None
            else:
                failed, self._unreported = self._unreported, []
                try:
                    sources = self.ask(version, chunk, 1, sorted(exclude), failed, held if self.report else None)
                except ServiceError as exc:
                    if exc.code is not ErrorCode.VERSION_UNAVAILABLE or not exclude or time.monotonic() > deadline:
                        raise
                    exclude.clear()  # every source named failed: ask afresh (a holder may have come back)
                    continue
            for source in sources:
                try:
                    via = self._read(source, version, chunk, into)
                except SOURCE_FAILURES as exc:
                    log.info("chunk %d of version %d from %s failed (%s); trying the next source",
                             chunk.index, version, source.holder_id, exc)
                    self.failures.append((chunk.index, source.holder_id, str(exc)))
                    self._drop_copy(source.holder_id)
                    exclude.add(source.holder_id)
                    self._ps_stale = self._ps_stale or source.url is None
                    if source.url is not None:
                        self._unreported.append(source.holder_id)
                    continue
                self.fetched[source.holder_id] = self.fetched.get(source.holder_id, 0) + 1
                self.fetched_via[via] = self.fetched_via.get(via, 0) + 1
                return

    def _read(self, source: ChunkSource, version: int, chunk: ChunkSpec, into: ByteRegions) -> str:
        """One chunk from ``source``, verified; returns the transport it came over."""
        url = source.url or (self.ps_url(self._ps_stale) if self.ps_url is not None else None)
        self._ps_stale = False
        if url is None:
            raise ConnectionError("no URL for the parameter server's copy")
        conn = self._connections.get(url)
        if conn is None:
            conn = self._connections[url] = RawHttpConnection(url, self.timeout, self.headers)
        copy = self._copy_of(source, conn) if source.url is not None else None
        if copy is not None:
            copy.read(conn, chunk, into)  # a connection that broke closed itself: the next request opens another
            return copy.transport
        self._read_http(conn, url, version, chunk, into)
        return "http"

    def _copy_of(self, source: ChunkSource, conn: RawHttpConnection) -> PeerCopy | None:
        """The lease on ``source``'s copy when it is read in memory (shm, nixl); None: over http."""
        copy = self._copies.get(source.holder_id)
        if copy is not None or self._pull is None or source.holder_id in self._http_only:
            return copy
        manifest, choice, verify = self._pull
        offered = source.transports
        via = peer_transport_for(choice, source.tier, offered, "nixl" in offered and choice in ("auto", "nixl") and nixl_here())
        if via == "http":
            return None
        try:
            copy = PeerCopy(conn, manifest, via, self._mover(via), verify)
        except TransportUnavailable as exc:
            log.info("reading %s over http: %s", source.holder_id, exc)
            self._http_only.add(source.holder_id)
            return None
        self._copies[source.holder_id] = copy
        self._urls[source.holder_id] = source.url or ""
        return copy

    def _mover(self, via: str) -> Any:
        mover = self._movers.get(via)
        if mover is None:
            if via == "shm":
                mover = ShmTransport(workers=1)
            else:
                from staleflow.transports.nixl import NixlTransport

                mover = NixlTransport()
            self._movers[via] = mover
        return mover

    def _drop_copy(self, holder: str) -> None:
        copy = self._copies.pop(holder, None)
        if copy is not None:
            copy.close(self._connections.get(self._urls.get(holder, "")))

    def _read_http(self, conn: RawHttpConnection, url: str, version: int, chunk: ChunkSpec, into: ByteRegions) -> None:
        try:
            conn.send("GET", API.chunk.target(version, chunk.index))
            status, headers = conn.read_head()
            length = int(headers["content-length"])
            if status != 200:
                raise_for_status(status, conn.read_body(length))
            if length != chunk.length:
                raise ConnectionError(f"{length} bytes announced, the manifest says {chunk.length}")
            views = into.views(chunk.offset, chunk.length)
            for _ in conn.read_into(views):
                pass
            verify_chunk(chunk, views)
        except BaseException:
            self._connections.pop(url, None)
            conn.close()
            raise

    def close(self) -> None:
        self._end_copies()
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
        for mover in self._movers.values():
            mover.close()
        self._movers.clear()


def ros_lease(manifest_json: Mapping[str, Any], puller: str, peers: str = "http") -> PullLease:
    """A lease-like handle on a version pulled from its holders, read over ``peers``
    (``PEER_TRANSPORTS``): the reference server keeps no lease (versions are immutable; a holder's
    own lease covers each read)."""
    return PullLease(f"ros-{puller}", Manifest.from_json(manifest_json), "ros", {"peers": check_peer_transport(peers)}, 0.0)
