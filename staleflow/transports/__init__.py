"""How a version's bytes move between the parameter server and its clients.

Every transport moves byte ranges of one format (``base``): ``http`` (anywhere, multi-node),
``shm`` (same host, shared memory) and ``nixl`` (NIXL/UCX, optional extra).
"""

from staleflow.transports.base import (
    ByteRegions,
    ChecksumMismatch,
    ChunkSpec,
    FormatError,
    Manifest,
    PullLease,
    PushSession,
    SlotReused,
    TensorSpec,
    Transport,
    TransportUnavailable,
)
from staleflow.transports.selection import TensorSlice, select_prefix, select_where

__all__ = [
    "ByteRegions",
    "ChecksumMismatch",
    "ChunkSpec",
    "FormatError",
    "Manifest",
    "PullLease",
    "PushSession",
    "SlotReused",
    "TensorSlice",
    "TensorSpec",
    "Transport",
    "TransportUnavailable",
    "select_prefix",
    "select_where",
]
