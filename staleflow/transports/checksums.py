"""Chunk checksums (xxh3_64 where both ends have it, else crc32), chunk by chunk or over a
gathered chunk's ranges, and how much of a pull is verified. Pure: hashes in-memory buffers."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from staleflow.transports.errors import ChecksumMismatch, FormatError
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions

try:  # xxh3 hashes at ~30 GB/s here, crc32 at ~6 GB/s: use xxh3 where both ends have it
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None




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

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            data = data.data
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._xxh.update(data)

    def hexdigest(self) -> str:
        value = self._crc if self.algorithm == "crc32" else self._xxh.intdigest()
        width = 8 if self.algorithm == "crc32" else 16
        return f"{self.algorithm}:{value:0{width}x}"


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


def verify_chunk(chunk: ChunkSpec, pieces: Iterable[Any]) -> None:
    """Raises ``ChecksumMismatch`` unless ``chunk``'s bytes, given in pieces in order, hash to its
    checksum."""
    actual = chunk_checksum(chunk, None, pieces)
    if actual != chunk.checksum:
        raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual)


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
