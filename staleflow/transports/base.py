"""What every parameter-server transport shares: the stored format, chunk checksums, and the one
interface a transport implements.

A version of the model is one safetensors file: an 8-byte little-endian header length, a JSON
header naming every tensor (dtype, shape, byte range), then the *data section* -- all tensor bytes
back to back. The data section is cut into fixed-size chunks; each chunk carries a checksum that
the receiver verifies. Transports only move byte ranges of the data section, so one manifest
(tensor table + chunk table) describes a version for all of them.

Pure logic and in-memory buffers only; no network or file I/O here.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import re
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from staleflow.api.params import ParamsRoutes
from staleflow.errors import ErrorCode, StaleFlowError

try:  # xxh3 hashes at ~30 GB/s here, crc32 at ~6 GB/s: use xxh3 where both ends have it
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

# safetensors dtype names and their widths in bytes
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

_NUMPY_TO_ST = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32", np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32",
    np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64", np.dtype(np.float64): "F64",
}
_ST_TO_NUMPY = {v: k for k, v in _NUMPY_TO_ST.items()}
# numpy has no bfloat16 / float8: ml_dtypes provides them where installed
_EXTENDED = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_SAME_WIDTH_UINT = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}

SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors readers' own limit


class FormatError(StaleFlowError, ValueError):
    """A state dict, manifest or header that cannot be stored or read."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_FORMAT):
        super().__init__(code, message)


class ChecksumMismatch(FormatError):
    def __init__(self, chunk_index: int, expected: str, actual: str):
        super().__init__(f"chunk {chunk_index}: checksum {actual} does not match the expected {expected}",
                         ErrorCode.CHECKSUM_MISMATCH)
        self.chunk_index = chunk_index
        self.expected = expected
        self.actual = actual


class SlotReused(StaleFlowError):
    """A shared-memory pull saw its version's slot change generation: the PS gave the slot to
    another version while the pull read it. Nothing read since is handed out."""

    def __init__(self, version: int, generation: int, current: int | None):
        now = "the slot is gone" if current is None else f"generation {current}"
        super().__init__(ErrorCode.SLOT_REUSED,
                         f"version {version}: its shared-memory slot was given to another version while this pull read it "
                         f"({now}; the lease was granted under generation {generation}): the pull lease lapsed, so finish "
                         f"an shm pull within the PS's --lease-ttl or raise it; no torn tensor was returned, pull again")
        self.version = version
        self.generation = generation
        self.current = current


VERIFY_MODES = ("auto", "checksum", "none")


def verify_mode(verify: bool | str) -> str:
    """A pull's ``verify`` argument as one of ``VERIFY_MODES``: ``auto`` hashes every byte over
    http and nixl and checks the slot's generation stamp over shm (the bytes were checksummed as
    they entered the slot); ``checksum`` (or True) hashes every byte over every transport;
    ``none`` (or False) checks nothing."""
    if verify is True:
        return "checksum"
    if verify is False:
        return "none"
    if verify in VERIFY_MODES:
        return str(verify)
    raise FormatError(f"verify={verify!r}: use 'auto' (checksums over http and nixl, the slot's generation over shm), "
                      f"'checksum' (hash every byte on every transport) or 'none'")


# ---------------------------------------------------------------- dtypes


def _ml_dtype(name: str) -> np.dtype | None:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, name))


def numpy_dtype(st_dtype: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype. BF16 / F8 need ``ml_dtypes``; without it they come
    back as the unsigned integer of the same width (the raw bits; the manifest keeps the real dtype)."""
    if st_dtype in _ST_TO_NUMPY:
        return _ST_TO_NUMPY[st_dtype]
    if st_dtype in _EXTENDED:
        return _ml_dtype(_EXTENDED[st_dtype]) or _SAME_WIDTH_UINT[DTYPE_SIZES[st_dtype]]
    raise FormatError(f"unknown dtype {st_dtype!r}; known: {', '.join(DTYPE_SIZES)}")


def safetensors_dtype(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype in _NUMPY_TO_ST:
        return _NUMPY_TO_ST[dtype]
    for st_name, ml_name in _EXTENDED.items():
        if dtype.name == ml_name:
            return st_name
    raise FormatError(f"numpy dtype {dtype} has no safetensors equivalent; convert it first")


# ---------------------------------------------------------------- layout


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


# ---------------------------------------------------------------- checksums


def checksum_algorithms() -> list[str]:
    """Available here, preferred first."""
    return (["xxh3_64"] if xxhash is not None else []) + ["crc32"]


class ChunkHasher:
    """Incremental checksum over the pieces of one chunk, in order."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        if algorithm == "xxh3_64":
            if xxhash is None:
                raise FormatError("checksum xxh3_64 needs the xxhash package here: pip install xxhash")
            self._xxh = xxhash.xxh3_64()
        elif algorithm == "crc32":
            self._crc = 0
        else:
            raise FormatError(f"unknown checksum algorithm {algorithm!r}; known: xxh3_64, crc32")

    def update(self, data: bytes | memoryview) -> None:
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._xxh.update(data)

    def hexdigest(self) -> str:
        value = self._crc if self.algorithm == "crc32" else self._xxh.intdigest()
        width = 8 if self.algorithm == "crc32" else 16
        return f"{self.algorithm}:{value:0{width}x}"


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-overlapping byte ranges in offset order, the ones that touch joined into one."""
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(r for r in ranges if r[1] > 0):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    return merged


def checksum_of(algorithm: str, pieces: Iterable[bytes | memoryview]) -> str:
    hasher = ChunkHasher(algorithm)
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()


def checksum_bytes(algorithm: str, data: Any) -> str:
    """One buffer's checksum: ``checksum_of`` one piece, without a hasher object (a call per
    small range of a gathered chunk)."""
    if algorithm == "xxh3_64" and xxhash is not None:
        return f"xxh3_64:{xxhash.xxh3_64_intdigest(data):016x}"
    return checksum_of(algorithm, [data])


def combined_checksum(algorithm: str, checksums: Sequence[str]) -> str:
    """The checksum of a chunk of several segments: the hash of their checksums, in order."""
    return checksum_of(algorithm, [",".join(checksums).encode()])


class SegmentHasher:
    """Incremental checksum over the pieces of a chunk of segments, in order: each segment (a run
    of ``lengths[i]`` bytes) hashed on its own, the chunk's checksum ``combined_checksum`` of
    theirs. Pieces may start and end anywhere; they are cut at the segments' ends."""

    def __init__(self, algorithm: str, lengths: Sequence[int]):
        self.algorithm = algorithm
        self.lengths = lengths
        self.checksums: list[str] = []  # of the segments hashed so far
        self._segment = ChunkHasher(algorithm)
        self._left = lengths[0]
        self._extra = False  # bytes beyond the last segment: the checksum cannot match

    def update(self, data: Any) -> None:
        taken, size = 0, len(data)
        while taken < size:
            if len(self.checksums) == len(self.lengths):
                self._extra = True
                return
            n = min(self._left, size - taken)
            self._segment.update(data[taken:taken + n] if n < size else data)
            taken += n
            self._left -= n
            if self._left == 0:
                self.checksums.append(self._segment.hexdigest())
                if len(self.checksums) < len(self.lengths):
                    self._segment = ChunkHasher(self.algorithm)
                    self._left = self.lengths[len(self.checksums)]

    def hexdigest(self) -> str:
        partial = [self._segment.hexdigest() + "+"] if len(self.checksums) < len(self.lengths) else []
        return combined_checksum(self.algorithm, self.checksums + partial + (["+"] if self._extra else []))


def chunk_hasher(chunk: ChunkSpec, algorithm: str | None = None) -> ChunkHasher | SegmentHasher:
    """The hasher of ``chunk``'s checksum, with its own algorithm unless ``algorithm`` is given
    (a push chunk's, before it has a checksum): plain for one run, ``SegmentHasher`` for several."""
    lengths = chunk.segment_lengths()
    algorithm = algorithm or checksum_algorithm(chunk.checksum or "")
    return SegmentHasher(algorithm, lengths) if len(lengths) > 1 else ChunkHasher(algorithm)


def chunk_checksum(chunk: ChunkSpec, algorithm: str | None, pieces: Iterable[Any]) -> str:
    """``chunk``'s checksum over its bytes, given in pieces in order (see ``chunk_hasher``)."""
    hasher = chunk_hasher(chunk, algorithm)
    for piece in pieces:
        hasher.update(piece)
    return hasher.hexdigest()


_CHECKSUM = re.compile(r"(xxh3_64|crc32):[0-9a-f]+")


def checksum_algorithm(checksum: str) -> str:
    match = _CHECKSUM.fullmatch(checksum) if isinstance(checksum, str) else None
    if match is None:
        raise FormatError(f"checksum {checksum!r} is not 'xxh3_64:<hex>' or 'crc32:<hex>'")
    return match.group(1)


def chunk_checksums(regions: ByteRegions, chunks: Sequence[ChunkSpec], algorithms: Sequence[str],
                    pool: Executor) -> Iterator[str]:
    """Each chunk's checksum over its bytes in ``regions`` (with the algorithm at the same
    position; see ``chunk_hasher``), hashed on ``pool``'s threads: xxhash and zlib release the
    GIL on large buffers, so the hashes run beside each other and beside the caller. Submitted at
    once, yielded in order."""
    return pool.map(lambda item: chunk_checksum(item[0], item[1], regions.gather(item[0].spans())),
                    zip(chunks, algorithms, strict=True))


# ---------------------------------------------------------------- byte regions


class ByteRegions:
    """The data section of one version mapped onto in-memory buffers: one flat buffer, or one
    buffer per tensor (the caller's arrays, zero-copy). Transports write pulled bytes into it and
    read pushed bytes from it by data-section offset."""

    def __init__(self, spans: Sequence[tuple[int, memoryview]], total_bytes: int):
        self._starts = [start for start, _ in spans]
        self._views = [view for _, view in spans]
        self.total_bytes = total_bytes

    @classmethod
    def flat(cls, buffer: memoryview | bytearray | np.ndarray) -> ByteRegions:
        view = _byte_view(buffer)
        return cls([(0, view)], len(view))

    @classmethod
    def per_tensor(cls, tensors: Sequence[TensorSpec], arrays: Mapping[str, Any]) -> ByteRegions:
        spans = []
        for spec in tensors:
            if spec.nbytes == 0:
                continue
            view = _byte_view(arrays[spec.name])
            if len(view) != spec.nbytes:
                raise FormatError(f"tensor {spec.name!r}: buffer has {len(view)} bytes, the manifest says {spec.nbytes}")
            spans.append((spec.offset, view))
        return cls(spans, sum(t.nbytes for t in tensors))

    def views(self, offset: int, length: int) -> list[memoryview]:
        """The pieces of buffers covering data-section bytes [offset, offset + length)."""
        if offset < 0 or offset + length > self.total_bytes:
            raise FormatError(f"range {offset}+{length} is outside the {self.total_bytes}-byte data section")
        out: list[memoryview] = []
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        end = offset + length
        while offset < end and i < len(self._views):
            start, view = self._starts[i], self._views[i]
            lo = offset - start
            hi = min(len(view), end - start)
            if lo < hi:
                out.append(view[lo:hi])
                offset = start + hi
            i += 1
        return out

    def gather(self, spans: Iterable[tuple[int, int]]) -> list[memoryview]:
        """The pieces of buffers covering each (offset, length) span in turn."""
        return [view for offset, length in spans for view in self.views(offset, length)]


def _byte_view(buffer: Any) -> memoryview:
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise FormatError("arrays must be C-contiguous; call np.ascontiguousarray first")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    view = memoryview(buffer)
    if not view.contiguous:
        raise FormatError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# ---------------------------------------------------------------- the transport interface


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


class TransportUnavailable(RuntimeError):
    """The transport cannot run here (a missing optional package, another host)."""


def pieces_of(chunk: ChunkSpec, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) sub-ranges of a chunk, each at most ``piece_bytes``."""
    end = chunk.offset + chunk.length
    for offset in range(chunk.offset, end, piece_bytes):
        yield offset, min(piece_bytes, end - offset)
