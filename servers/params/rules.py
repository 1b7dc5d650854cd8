"""The parameter server's rules, pure (no I/O): version specs, retention, how a part's byte ranges
are cut into chunks and a version's chunk table is cut anew at its commit, when parts tile a
version, the records the store keeps (stored versions, pushes in progress and their parts, pull
leases), and the checksums a pusher hands in."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.transports.checksums import checksum_algorithm, combined_checksum
from staleflow.transports.errors import FormatError
from staleflow.transports.layout import ChunkSpec, Manifest, TensorSpec
from staleflow.transports.regions import merge_ranges

if TYPE_CHECKING:
    from staleflow.transports.shm import ShmSlot


_VERSION_SPEC = re.compile(r"^(?:(\d{1,18})|latest(?:-(\d{1,18}))?)$")


class ParamsError(StaleFlowError):
    """A request the parameter store refuses."""


def parse_version_spec(spec: str) -> tuple[str, int]:
    """``"42"`` -> ("exact", 42); ``"latest"`` -> ("latest", 0); ``"latest-2"`` -> ("latest", 2)."""
    match = _VERSION_SPEC.match(spec)
    if not match:
        raise ParamsError(ErrorCode.INVALID_VERSION, f"version {spec!r} must be a number, 'latest' or 'latest-N'")
    if match.group(1) is not None:
        return "exact", int(match.group(1))
    return "latest", int(match.group(2) or 0)


def shm_prefix(state_dir: Path) -> str:
    """Shared-memory segment names of the PS on ``state_dir``: a restart on the same directory
    finds (and removes) what a killed predecessor left."""
    return "staleflow-ps-" + hashlib.blake2b(str(state_dir.resolve()).encode(), digest_size=6).hexdigest()


def versions_to_drop(committed: Iterable[int], keep: int) -> list[int]:
    """Retention: everything but the newest ``keep`` complete versions."""
    return sorted(committed)[:-keep] if keep > 0 else sorted(committed)


SMALL_RANGE_BYTES = 4 << 20  # below this a range is gathered with others (push) and joined with its neighbours (manifest)


def small_range_bytes(chunk_bytes: int) -> int:
    """Ranges shorter than this are small: a chunk of their own would cost more (a request, a
    copy task, a manifest entry, per-chunk work on every pull) than one more segment of a chunk
    joined with others (a hash call)."""
    return min(chunk_bytes, SMALL_RANGE_BYTES)


def split_ranges(ranges: Sequence[tuple[int, int]], chunk_bytes: int, gather: bool = False) -> list[ChunkSpec]:
    """A part's byte ranges of the data section cut into chunks of at most ``chunk_bytes``,
    numbered within the part. Ranges that touch (a pusher's consecutive tensors, each its own
    range) are joined first, so a table of many small tensors makes as few chunks -- requests,
    checksums, copies -- as one big tensor of the same bytes. ``gather``: the small ranges left
    apart (a rank of several holds dim-0 rows of every tensor, which are not adjacent) are
    gathered, in offset order, into chunks of several ranges of at most ``chunk_bytes`` in all."""
    chunks: list[ChunkSpec] = []
    small = small_range_bytes(chunk_bytes)
    gathered: list[tuple[int, int]] = []
    filled = 0

    def flush() -> None:
        nonlocal gathered, filled
        if len(gathered) == 1:
            chunks.append(ChunkSpec(len(chunks), gathered[0][0], gathered[0][1]))
        elif gathered:
            chunks.append(ChunkSpec(len(chunks), gathered[0][0], filled, ranges=tuple(gathered)))
        gathered, filled = [], 0

    for offset, length in merge_ranges(ranges):
        if gather and length < small:
            if filled + length > chunk_bytes:
                flush()
            gathered.append((offset, length))
            filled += length
            continue
        for start in range(offset, offset + length, chunk_bytes):
            chunks.append(ChunkSpec(len(chunks), start, min(chunk_bytes, offset + length - start)))
    flush()
    return chunks


def manifest_chunks(delivered: Iterable[tuple[ChunkSpec, str | None, Sequence[str] | None]],
                    chunk_bytes: int) -> list[ChunkSpec]:
    """A version's chunk table, cut anew over the data section its parts' delivered chunks tile
    (each with its checksum, and a gathered one with its ranges' checksums where known). A
    contiguous chunk of at least ``small_range_bytes`` keeps its place and checksum. The runs
    between such chunks (small chunks and gathered ranges, of any parts, one after the other in
    the data section) are joined into chunks of at most ``chunk_bytes``, cut where runs meet; a
    joined chunk's checksum is the ``combined_checksum`` of its runs' (``segments``: their
    lengths), so no byte is hashed twice. A chunk with a run of unknown checksum, or runs hashed
    with different algorithms, is left with ``checksum=None``: the PS hashes its bytes before the
    version is visible. Pure: no bytes are read here."""
    small = small_range_bytes(chunk_bytes)
    runs: list[tuple[int, int, str | None, bool]] = []  # (offset, length, checksum, kept whole)
    for chunk, checksum, range_checksums in delivered:
        if chunk.ranges:
            sums = range_checksums or [None] * len(chunk.ranges)
            runs.extend((offset, length, x, False) for (offset, length), x in zip(chunk.ranges, sums, strict=True))
        elif chunk.length:
            runs.append((chunk.offset, chunk.length, checksum, checksum is not None and chunk.length >= small))
    runs.sort(key=lambda run: run[0])
    out: list[ChunkSpec] = []
    joined: list[tuple[int, int, str | None, bool]] = []
    filled = 0

    def flush() -> None:
        nonlocal joined, filled
        if len(joined) == 1:
            out.append(ChunkSpec(len(out), joined[0][0], joined[0][1], joined[0][2]))
        elif joined:
            sums = [run[2] for run in joined if run[2] is not None]
            algorithms = {checksum_algorithm(x) for x in sums}
            if len(sums) == len(joined) and len(algorithms) == 1:
                out.append(ChunkSpec(len(out), joined[0][0], filled, combined_checksum(algorithms.pop(), sums),
                                     segments=tuple(run[1] for run in joined)))
            else:
                out.append(ChunkSpec(len(out), joined[0][0], filled))
        joined, filled = [], 0

    for run in runs:
        offset, length, checksum, whole = run
        if whole:
            flush()
            out.append(ChunkSpec(len(out), offset, length, checksum))
            continue
        if filled + length > chunk_bytes:
            flush()
        joined.append(run)
        filled += length
    flush()
    return out


def coverage_gaps(ranges: Iterable[tuple[int, int]], total_bytes: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(overlaps, gaps) of byte ranges against the data section [0, total_bytes): a sharded
    version is complete when its parts' ranges tile it exactly."""
    overlaps, gaps = [], []
    position = 0
    for offset, length in sorted(r for r in ranges if r[1] > 0):
        if offset < position:
            overlaps.append((offset, min(position, offset + length) - offset))
        elif offset > position:
            gaps.append((position, offset - position))
        position = max(position, offset + length)
    if position < total_bytes:
        gaps.append((position, total_bytes - position))
    return overlaps, gaps


@dataclass
class StoredVersion:
    """A complete, visible version: in a memory slot (``slot``), on disk (``directory``), or both."""

    manifest: Manifest
    fd: int  # where its bytes are read from: the memory slot, else the persisted file
    file_size: int
    slot: ShmSlot | None = None
    directory: Path | None = None
    leases: int = 0  # pull leases, streams and the persister pin it
    retained: bool = True  # False: beyond the newest K, deleted once ``leases`` reaches 0
    persisted: bool = False
    persist_seconds: float | None = None  # its persist started until it was on disk
    persist_yielded_seconds: float | None = None  # of which it waited for pushes and pulls to end
    visible_seconds: float | None = None  # from the push's start until it was visible
    visible_at_monotonic: float | None = None  # when it became visible (this host's monotonic clock)
    held: set[int] | None = None  # a copy from holders in progress: the chunks verified so far (None: complete)
    abandoned: bool = False  # a copy in progress that was given up: freed once its readers end

    def summary(self) -> dict:
        return {**self.manifest.summary(), "leases": self.leases, "retained": self.retained,
                "in_memory": self.slot is not None, "persisted": self.persisted,
                "persist_seconds": self.persist_seconds, "persist_yielded_seconds": self.persist_yielded_seconds,
                "visible_seconds": self.visible_seconds,
                "visible_at_monotonic": self.visible_at_monotonic}


@dataclass
class PushPart:
    """What one pusher (e.g. one trainer rank) delivers: its byte ranges of the data section."""

    index: int
    via: str  # "http": chunk bodies to the PS; "shm", "nixl": the pusher writes into the slot itself
    chunks: list[ChunkSpec]
    received: dict[int, str | None] = field(default_factory=dict)  # chunk index -> checksum (None: the PS hashes it)
    range_checksums: dict[int, tuple[str, ...]] = field(default_factory=dict)  # a gathered chunk's ranges' checksums
    writing: set[int] = field(default_factory=set)
    done: bool = False

    def ranges(self) -> list[tuple[int, int]]:
        return [span for c in self.chunks for span in c.spans()]


@dataclass
class PendingPush:
    push_id: str
    version: int
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    slot: ShmSlot
    data_offset: int
    metadata: dict[str, str]
    expected_parts: int
    parts: dict[int, PushPart] = field(default_factory=dict)
    table: str = ""  # the tensor table's digest
    committing: bool = False
    dropped: str | None = None  # why it was dropped, for parts waiting on it
    started: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)

    @property
    def fd(self) -> int:
        assert self.slot.fd is not None
        return self.slot.fd

    @property
    def writing(self) -> bool:
        return any(p.writing for p in self.parts.values())

    def progress(self) -> dict:
        received = sum(p.chunks[i].length for p in self.parts.values() for i in p.received)
        return {"version": self.version, "push_id": self.push_id, "parts": self.expected_parts,
                "parts_joined": sorted(self.parts), "parts_done": sorted(i for i, p in self.parts.items() if p.done),
                "chunks": sum(len(p.chunks) for p in self.parts.values()),
                "received_chunks": sum(len(p.received) for p in self.parts.values()),
                "received_bytes": received, "total_bytes": self.total_bytes,
                "writing": sorted((i, c) for i, p in self.parts.items() for c in p.writing), "committing": self.committing}


@dataclass
class Lease:
    lease_id: str
    version: int
    transport: str
    expires_at: float


def claimed_checksums(entry: PushPart, checksums: Mapping[int, str | list[str]]) -> tuple[dict[int, str], dict[int, tuple[str, ...]]]:
    """A part's checksums as its pusher hands them in (over shm or NIXL), validated: (chunk index
    -> checksum, gathered chunk index -> its ranges' checksums, where it gave those instead)."""
    claimed: dict[int, str] = {}
    ranges: dict[int, tuple[str, ...]] = {}
    for index, checksum in checksums.items():
        if not 0 <= int(index) < len(entry.chunks):
            raise ParamsError(ErrorCode.UNKNOWN_CHUNK, f"part {entry.index} has chunks 0..{len(entry.chunks) - 1}, not {index}")
        chunk = entry.chunks[int(index)]
        listed = [checksum] if isinstance(checksum, str) else list(checksum)
        if not isinstance(checksum, str) and len(listed) != len(chunk.ranges):
            raise ParamsError(ErrorCode.INVALID_FORMAT, f"chunk {index} of part {entry.index} gathers {len(chunk.ranges)} range(s); "
                                                        f"{len(listed)} checksum(s) were handed in for them")
        try:
            algorithms = {checksum_algorithm(x) for x in listed}
        except FormatError as exc:
            raise ParamsError(ErrorCode.INVALID_FORMAT, str(exc)) from None
        if len(algorithms) != 1:
            raise ParamsError(ErrorCode.INVALID_FORMAT, f"chunk {index} of part {entry.index}: its ranges' checksums mix algorithms")
        if isinstance(checksum, str):
            claimed[int(index)] = checksum
        else:
            claimed[int(index)] = combined_checksum(algorithms.pop(), listed)
            ranges[int(index)] = tuple(listed)
    return claimed, ranges
