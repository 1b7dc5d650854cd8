"""The one interface a parameter-server transport implements (``Transport``), and what it is
handed: a pull's lease, a push's session. The format they move is ``layout``, its checksums
``checksums``, the buffers ``regions``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from staleflow.api.params import ParamsRoutes
from staleflow.transports.layout import ChunkSpec, Manifest
from staleflow.transports.regions import ByteRegions


@dataclass(frozen=True)
class PullLease:
    """The PS's answer to "I am about to pull version v over transport t": the manifest, and
    whatever the transport needs to find the bytes (a segment path, agent metadata, ...). The
    version stays stored until the lease is released or expires."""

    lease_id: str
    manifest: Manifest
    transport: str
    details: Mapping[str, Any] = field(default_factory=dict)
    ttl_s: float = 0.0


@dataclass(frozen=True)
class PushSession:
    """One pusher's share of a push: its chunks (data-section ranges) and where they go. ``part``
    is None for a one-pusher push; ``details`` is what the PS said about the memory slot (its
    path for shm; its NIXL agent and address for nixl)."""

    push_id: str
    version: int
    chunks: tuple[ChunkSpec, ...]
    checksum_algorithm: str
    part: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def chunk_target(self, index: int) -> str:
        if self.part is None:
            return ParamsRoutes.put_chunk.target(self.version, index, push_id=self.push_id)
        return ParamsRoutes.put_part_chunk.target(self.version, self.part, index, push_id=self.push_id)


class Transport(ABC):
    """Client side of one way of moving a version's bytes. ``pull`` writes the data section into
    ``into`` and yields each (offset, length) range as it lands, in order and never straddling a
    chunk boundary; the caller verifies the chunk checksums from those ranges."""

    name: ClassVar[str]

    @abstractmethod
    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]: ...

    def push(self, session: PushSession, source: ByteRegions) -> dict[int, str | list[str]] | None:
        """Deliver the session's chunks from ``source``. Returns the chunks' checksums when the PS
        did not receive the bytes itself (the pusher wrote them into its memory), else None; a
        gathered chunk's may be the list of its ranges' checksums."""
        raise NotImplementedError(f"transport {self.name!r} only pulls; push over 'http', 'shm' or 'nixl'")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release cached connections or mappings."""
