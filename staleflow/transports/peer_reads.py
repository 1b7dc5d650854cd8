"""Reading a peer holder's copy of a version straight out of its memory: over shm from a holder on
this host, over nixl where both sides have it (``PeerTransport`` picks per source with
``peer_transport_for``; http stays the fallback everywhere).

A reader holds a lease on the holder's copy (``PeerRoutes.open_lease`` on the holder's data
plane), so the holder does not reuse the copy's slot while it reads, even once it unpublished
the version or gave the copy up. A copy still being pulled (pipeline replication) is read as its
chunks land: the lease lists the chunks landed when it was granted; for any other chunk the
reader sends ``HEAD`` of the chunk to the holder's data plane, which answers once the chunk
landed verified, with the end of the run of landed chunks from it. Shared memory has no request
to block on, so the wait is an HTTP request of no body, and the bytes then come from memory.

Verification: over shm as the parameter server's shm pulls (``verify="auto"``: the slot's
generation stamp, checked after each chunk is copied; ``checksum``: every byte hashed against the
manifest); over nixl every chunk is hashed (the bytes crossed an RDMA engine).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence

from staleflow.api.base import ServiceError
from staleflow.api.params import PeerRoutes
from staleflow.errors import ErrorCode
from staleflow.transports.base import PullLease
from staleflow.transports.checksums import verify_chunk
from staleflow.transports.errors import TransportUnavailable
from staleflow.transports.http import LANDED_THROUGH_HEADER, RawHttpConnection, raise_for_status
from staleflow.transports.layout import ChunkSpec, Manifest
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import ShmTransport, host_id

PEER_TRANSPORTS = ("auto", "shm", "nixl", "http")
"""How a puller reads holders: ``auto`` shm from a holder on its host, else nixl where both
offer it, else http; ``shm`` or ``nixl``: that one where it can, else http; ``http``: http."""


def check_peer_transport(choice: str) -> str:
    if choice not in PEER_TRANSPORTS:
        raise ValueError(f"peer transport {choice!r}: use {', '.join(PEER_TRANSPORTS)}")
    return choice


def peer_transport_for(choice: str, tier: str, offered: Sequence[str], nixl_here: bool) -> str:
    """The transport to read a source with: ``choice`` (``PEER_TRANSPORTS``), the source's ``tier``
    as the reference server ranked it (``host``: on the puller's host), the transports it serves
    peers over, and whether this process can run nixl."""
    check_peer_transport(choice)
    if choice in ("auto", "shm") and tier == "host" and "shm" in offered:
        return "shm"
    if choice in ("auto", "nixl") and nixl_here and "nixl" in offered:
        return "nixl"
    return "http"


@functools.cache
def nixl_here() -> bool:
    """Whether NIXL loads in this process (asked once: it imports torch)."""
    from staleflow.transports.nixl import nixl_available

    return nixl_available()[0]


class PeerCopy:
    """A lease on one holder's copy of ``manifest``'s version, read chunk by chunk over
    ``transport`` (shm or nixl) through ``mover``. Raises ``TransportUnavailable`` when the copy
    cannot be read that way from here (another host after all, a transport the holder does not
    enable): read that holder over http instead."""

    def __init__(self, conn: RawHttpConnection, manifest: Manifest, transport: str, mover: object, verify: str):
        self.transport, self.mover, self.verify = transport, mover, verify
        status, _, body = conn.request("POST", PeerRoutes.open_lease.target(manifest.version, transport=transport))
        try:
            raise_for_status(status, body)
        except ServiceError as exc:
            if exc.code is ErrorCode.TRANSPORT_DISABLED:
                raise TransportUnavailable(str(exc)) from None
            raise
        reply = json.loads(body)
        self.lease = PullLease(reply["lease_id"], manifest, transport, reply["details"], reply["ttl_s"])
        self.landed: set[int] | None = None if reply["held"] is None else set(reply["held"])
        if transport == "shm" and self.lease.details.get("host_id") != host_id():
            self.close(conn)
            raise TransportUnavailable("the holder's shared memory is on another host")

    def read(self, conn: RawHttpConnection, chunk: ChunkSpec, into: ByteRegions) -> None:
        """``chunk`` into ``into``, verified; waits (``HEAD``) for a chunk the copy has not landed yet."""
        if self.landed is not None and chunk.index not in self.landed:
            self._wait(conn, chunk.index)
        if isinstance(self.mover, ShmTransport):
            self.mover.read_chunk(self.lease, chunk, into, self.verify)
            return
        self.mover.read_chunk(self.lease, chunk, into)  # type: ignore[attr-defined]
        verify_chunk(chunk, into.views(chunk.offset, chunk.length))

    def _wait(self, conn: RawHttpConnection, index: int) -> None:
        assert self.landed is not None
        conn.send("HEAD", PeerRoutes.chunk_landed.target(self.lease.manifest.version, index, lease=self.lease.lease_id))
        status, headers = conn.read_head()
        if status != 200:
            raise_for_status(status, conn.read_body(int(headers["content-length"])))
        self.landed.update(range(index, max(index + 1, int(headers.get(LANDED_THROUGH_HEADER, index + 1)))))

    def close(self, conn: RawHttpConnection | None) -> None:
        """Ends the lease (best effort: one the holder cannot hear of lapses there)."""
        if conn is None:
            return
        with contextlib.suppress(OSError, ConnectionError, ServiceError, ValueError, KeyError):
            status, _, body = conn.request("DELETE", PeerRoutes.close_lease.target(self.lease.lease_id))
            raise_for_status(status, body)
