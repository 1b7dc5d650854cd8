"""How a version's bytes move between the parameter server and its clients.

Every transport (``base``: the interface) moves byte ranges of one format (``layout``, its
checksums ``checksums``, the buffers ``regions``): ``http`` (anywhere, multi-node),
``shm`` (same host, shared memory) and ``nixl`` (NIXL/UCX, optional extra).
"""

from staleflow.transports.base import PullLease, PushSession, Transport
from staleflow.transports.errors import ChecksumMismatch, FormatError, SlotReused, TransportUnavailable
from staleflow.transports.layout import ChunkSpec, Manifest, TensorSpec
from staleflow.transports.regions import ByteRegions
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
