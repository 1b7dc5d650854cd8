"""The stored format of a version: one safetensors file, an 8-byte little-endian header length, a
JSON header naming every tensor (dtype, shape, byte range), then the *data section* -- all tensor
bytes back to back. The data section is cut into chunks, each with a checksum; transports only
move byte ranges of the data section, so one ``Manifest`` (tensor table + chunk table) describes a
version for all of them. Pure: no I/O."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staleflow.transports.dtypes import DTYPE_SIZES
from staleflow.transports.errors import FormatError

SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors readers' own limit



@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # in the data section
    nbytes: int = 0

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d.get("offset", 0), d.get("nbytes", 0))


@dataclass(frozen=True)
class ChunkSpec:
    """A chunk: ``length`` bytes of the data section from ``offset``, with its checksum. A push's
    chunk may instead *gather* several ranges of the data section (``ranges``: (offset,
    length) pairs in offset order; ``offset`` is the first one's, ``length`` their sum): one
    request and one checksum, over the ranges' bytes one after the other, for a pusher's many
    small shards. A manifest's chunks are always one range.

    A chunk of *segments* (a gathered chunk's ranges; ``segments``: the lengths of consecutive
    runs of a manifest chunk, each hashed by the pusher that wrote it) has for checksum the
    hash of its segments' checksums (``combined_checksum``): parts' bytes joined in one chunk
    need no second pass over them. ``chunk_hasher`` computes either kind."""

    index: int
    offset: int  # in the data section
    length: int
    checksum: str | None = None  # "algorithm:hex"; None while a push has not delivered it
    ranges: tuple[tuple[int, int], ...] = ()  # a gathered push chunk's ranges; () for one range
    segments: tuple[int, ...] = ()  # a manifest chunk's segment lengths, summing to ``length``; () for one

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The (offset, length) ranges of the data section the chunk's bytes are, in order."""
        return self.ranges or ((self.offset, self.length),)

    def segment_lengths(self) -> tuple[int, ...]:
        """The lengths of the runs its checksum is made of (one run: the plain hash of its bytes)."""
        return self.segments or tuple(n for _, n in self.ranges) or (self.length,)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "offset": self.offset, "length": self.length, "checksum": self.checksum}
        if self.ranges:
            out["ranges"] = [list(r) for r in self.ranges]
        if self.segments:
            out["segments"] = list(self.segments)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ChunkSpec:
        ranges = tuple((int(o), int(n)) for o, n in d.get("ranges") or ())
        segments = tuple(int(n) for n in d.get("segments") or ())
        if segments and (sum(segments) != d["length"] or min(segments) <= 0):
            raise FormatError(f"chunk {d['index']}: segments {list(segments)[:5]}... do not tile its {d['length']} bytes")
        return cls(d["index"], d["offset"], d["length"], d.get("checksum"), ranges, segments)


def layout_tensors(specs: Iterable[tuple[str, str, Sequence[int]]], max_tensors: int = 1_000_000) -> list[TensorSpec]:
    """Place tensors back to back in the data section, in the given order. Validates names, dtypes
    and shapes. A table laid out before (every push of a model names the same one) comes from a
    small cache: one pass to build its key instead of the validation and layout per tensor."""
    return list(laid_table(specs, max_tensors)[0])


def laid_table(specs: Iterable[tuple[str, str, Sequence[int]]],
               max_tensors: int = 1_000_000) -> tuple[tuple[TensorSpec, ...], str]:
    """``layout_tensors`` and the table's digest (of its safetensors header entries: names,
    dtypes, shapes, offsets), computed once per table: a pusher names a table the PS has by it."""
    specs = list(specs)
    if len(specs) > max_tensors:
        raise FormatError(f"more than {max_tensors} tensors")
    try:
        key: tuple | None = tuple((name, dtype, tuple(shape)) for name, dtype, shape in specs)
    except TypeError:  # not triples of hashables: the checks below say what is wrong
        key = None
    if key is not None and not all(type(d) is int for _, _, shape in key for d in shape):
        key = None  # 2.0 or True would equal a valid 2 or 1 in the cache; let the checks refuse them
    cached = _LAYOUTS.get(key) if key is not None else None
    if cached is not None:
        return cached
    laid = tuple(_layout_checked(specs, max_tensors))
    entry = laid, hashlib.blake2b(_header_entries(laid).encode(), digest_size=16).hexdigest()
    if key is not None:
        if len(_LAYOUTS) >= _LAYOUT_CACHE_SIZE:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = entry
    return entry


_LAYOUT_CACHE_SIZE = 8
_LAYOUTS: dict[tuple, tuple[tuple[TensorSpec, ...], str]] = {}


MAX_DIMS = 64
MAX_TABLE_BYTES = 1 << 50
"""A tensor table's data section is at most this (1 PiB): far beyond any host's memory, and well
inside what the offsets, file sizes and memory mappings it turns into can hold (64-bit)."""


def _layout_checked(specs: Sequence[tuple[str, str, Sequence[int]]], max_tensors: int) -> list[TensorSpec]:
    laid: list[TensorSpec] = []
    seen: set[str] = set()
    offset = 0
    for name, dtype, shape in specs:
        if not isinstance(name, str) or not name or name == "__metadata__" or len(name) > 1024:
            raise FormatError(f"invalid tensor name {name!r}: a non-empty string of at most 1024 characters, not '__metadata__'")
        if name in seen:
            raise FormatError(f"tensor name {name!r} appears twice")
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise FormatError(f"tensor {name!r}: shape {list(shape)[:MAX_DIMS]} must be non-negative integers")
        if len(shape) > MAX_DIMS or any(d > MAX_TABLE_BYTES for d in shape):
            raise FormatError(f"tensor {name!r}: a shape has at most {MAX_DIMS} dimensions of at most {MAX_TABLE_BYTES} each")
        seen.add(name)
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        if offset + nbytes > MAX_TABLE_BYTES:
            raise FormatError(f"tensor {name!r}: the table's tensors come to more than {MAX_TABLE_BYTES} bytes "
                              f"(shape {list(shape)} of {dtype} is {nbytes} bytes)")
        laid.append(TensorSpec(name, dtype, tuple(shape), offset, nbytes))
        offset += nbytes
        if len(laid) > max_tensors:
            raise FormatError(f"more than {max_tensors} tensors")
    if not laid:
        raise FormatError("a state dict needs at least one tensor")
    return laid


def plan_chunks(total_bytes: int, chunk_bytes: int) -> list[ChunkSpec]:
    if chunk_bytes <= 0:
        raise FormatError("chunk_bytes must be positive")
    return [ChunkSpec(i, off, min(chunk_bytes, total_bytes - off))
            for i, off in enumerate(range(0, total_bytes, chunk_bytes))]


def safetensors_header(tensors: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None, align: int = 8) -> bytes:
    """The file prefix: length + JSON header, padded with spaces so the data starts ``align``-aligned
    (a multiple of 8)."""
    entries = _header_entries(tuple(tensors))
    if metadata:
        meta = json.dumps({"__metadata__": {str(k): str(v) for k, v in metadata.items()}}, separators=(",", ":"))
        body = (meta[:-1] + ("," + entries[1:] if len(entries) > 2 else "}")).encode()
    else:
        body = entries.encode()
    body += b" " * (-(8 + len(body)) % align)
    return struct.pack("<Q", len(body)) + body


@functools.lru_cache(maxsize=8)
def _header_entries(tensors: tuple[TensorSpec, ...]) -> str:
    """The header's tensor entries as a JSON object: the same for every version of a model."""
    return json.dumps({t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
                       for t in tensors}, separators=(",", ":"))


def parse_safetensors_header(prefix: bytes) -> tuple[int, list[TensorSpec], dict[str, str]]:
    """(data_offset, tensors in file order, metadata) from the first bytes of a safetensors file."""
    if len(prefix) < 8:
        raise FormatError("not a safetensors file: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > SAFETENSORS_MAX_HEADER or len(prefix) < 8 + length:
        raise FormatError(f"safetensors header of {length} bytes is truncated or too large")
    try:
        header = json.loads(prefix[8:8 + length])
    except ValueError as exc:
        raise FormatError(f"safetensors header is not JSON: {exc}") from None
    metadata = header.pop("__metadata__", {}) or {}
    tensors = sorted(
        (TensorSpec(name, d["dtype"], tuple(d["shape"]), d["data_offsets"][0], d["data_offsets"][1] - d["data_offsets"][0])
         for name, d in header.items()),
        key=lambda t: t.offset,
    )
    return 8 + length, tensors, metadata


@dataclass(frozen=True)
class Manifest:
    """Everything a puller needs to know about one complete version."""

    version: int
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[ChunkSpec, ...]
    chunk_bytes: int
    data_offset: int  # where the data section starts in the stored safetensors file
    metadata: Mapping[str, str] = field(default_factory=dict)
    committed_at: float | None = None

    @property
    def total_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "total_bytes": self.total_bytes,
            "chunk_bytes": self.chunk_bytes,
            "data_offset": self.data_offset,
            "metadata": dict(self.metadata),
            "committed_at": self.committed_at,
            "tensors": [t.to_json() for t in self.tensors],
            "chunks": [c.to_json() for c in self.chunks],
        }

    def summary(self) -> dict:
        return {"version": self.version, "total_bytes": self.total_bytes, "tensors": len(self.tensors),
                "chunks": len(self.chunks), "chunk_bytes": self.chunk_bytes, "committed_at": self.committed_at}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Manifest:
        try:
            return cls(
                version=int(d["version"]),
                tensors=tuple(TensorSpec.from_json(t) for t in d["tensors"]),
                chunks=tuple(ChunkSpec.from_json(c) for c in d["chunks"]),
                chunk_bytes=int(d["chunk_bytes"]),
                data_offset=int(d["data_offset"]),
                metadata=dict(d.get("metadata") or {}),
                committed_at=d.get("committed_at"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"malformed manifest: {exc!r}") from None
