"""Selected pulls: only some tensors of a version, each whole or only one tensor-parallel slice.

A selection maps tensor names to ``None`` (the whole tensor) or a :class:`TensorSlice` (one of
``count`` parts along ``dim``). :func:`plan_selection` turns it into byte arithmetic over the
version's data section: where each selected tensor's bytes are (a :class:`Strided` region:
``runs`` contiguous runs of ``run_bytes``, ``stride`` apart), which chunks those bytes touch, and
per touched chunk the copies (:class:`Block`) that move its selected bytes into the destination
buffers. The transports move and verify whole chunks (or hash them in place) and copy the blocks.

Pure logic and numpy views only; no network or file I/O here.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from staleflow.transports.base import PullLease
from staleflow.transports.dtypes import DTYPE_SIZES
from staleflow.transports.errors import FormatError
from staleflow.transports.layout import ChunkSpec, Manifest, TensorSpec

TARGET_ALIGN = 64  # where each selected tensor starts in a freshly allocated buffer


@dataclass(frozen=True)
class TensorSlice:
    """The ``index``-th of ``count`` parts of a tensor along ``dim`` (negative dims count from the
    end). Parts are split like ``numpy.array_split`` / ``torch.tensor_split``: with ``n`` elements
    along ``dim``, ``q, r = divmod(n, count)``, the first ``r`` parts get ``q + 1`` and the rest
    ``q``, so every index in ``[0, count)`` is a valid (possibly empty) part. When ``count``
    divides ``n`` -- what vLLM's column-parallel (``dim=0`` of a ``[out, in]`` weight) and
    row-parallel (``dim=1``) layers require -- part ``i`` is ``[i * n/count, (i + 1) * n/count)``."""

    dim: int
    index: int
    count: int

    def __post_init__(self) -> None:
        for field_name in ("dim", "index", "count"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise FormatError(f"TensorSlice.{field_name} must be an integer, not {value!r}")
        if self.count < 1:
            raise FormatError(f"TensorSlice(count={self.count}): count must be at least 1")
        if not 0 <= self.index < self.count:
            raise FormatError(f"TensorSlice(index={self.index}, count={self.count}): index must be in [0, {self.count})")

    def bounds(self, size: int) -> tuple[int, int]:
        """[start, stop) of this part among ``size`` elements."""
        quotient, remainder = divmod(size, self.count)
        start = self.index * quotient + min(self.index, remainder)
        return start, start + quotient + (1 if self.index < remainder else 0)


Choice = TensorSlice | None  # one tensor: whole (None) or one part
Resolved = Mapping[str, Choice] | Iterable[str]  # a list of names: those tensors whole
Selection = Resolved | Callable[[Manifest], Resolved]  # a callable is resolved against the manifest


def select_where(predicate: Callable[[TensorSpec], bool],
                 part: TensorSlice | Callable[[TensorSpec], TensorSlice | None] | None = None) -> Callable[[Manifest], dict[str, Choice]]:
    """A selection of the tensors ``predicate`` accepts, each whole (``part=None``), the same
    slice of each, or the slice ``part(spec)`` gives per tensor (``None``: that one whole). It is
    resolved against the pulled version's manifest."""

    def resolve(manifest: Manifest) -> dict[str, Choice]:
        chosen = {spec.name: part(spec) if callable(part) else part for spec in manifest.tensors if predicate(spec)}
        if not chosen:
            raise FormatError(f"no tensor of version {manifest.version} matches the selection")
        return chosen

    return resolve


def select_prefix(*prefixes: str, part: TensorSlice | Callable[[TensorSpec], TensorSlice | None] | None = None
                  ) -> Callable[[Manifest], dict[str, Choice]]:
    """The tensors whose names start with one of ``prefixes`` (e.g. one pipeline stage's layers)."""
    if not prefixes or not all(isinstance(p, str) for p in prefixes):
        raise FormatError("select_prefix needs one or more name prefixes (strings)")
    return select_where(lambda spec: spec.name.startswith(prefixes), part)


class Strided(NamedTuple):
    """Bytes of the data section: ``runs`` runs of ``run_bytes`` contiguous bytes, the first at
    ``offset`` and each ``stride`` after the previous one."""

    offset: int
    runs: int
    run_bytes: int
    stride: int

    @property
    def nbytes(self) -> int:
        return self.runs * self.run_bytes

    @property
    def end(self) -> int:
        """One past the last byte (``offset`` when empty)."""
        return self.offset + (self.runs - 1) * self.stride + self.run_bytes if self.nbytes else self.offset


class Block(NamedTuple):
    """One copy: ``rows`` rows of ``row_bytes``, from data-section offset ``source`` (rows
    ``stride`` apart) to byte ``target`` of the tensor's destination (rows back to back)."""

    source: int
    rows: int
    row_bytes: int
    stride: int
    target: int


@dataclass(frozen=True)
class SelectedTensor:
    spec: TensorSpec  # the tensor as stored
    part: TensorSlice | None
    shape: tuple[int, ...]  # as pulled
    region: Strided
    target_offset: int  # where it starts in a freshly allocated buffer of SelectionPlan.buffer_bytes

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        return self.region.nbytes


@dataclass(frozen=True)
class ChunkStep:
    """One touched chunk and the selected tensors with bytes in it: (position, region), in
    data-section order."""

    chunk: ChunkSpec
    regions: tuple[tuple[int, Strided], ...]

    @property
    def copies(self) -> list[tuple[int, Block]]:
        """The copies of the selected bytes in this chunk: (tensor position, block)."""
        return self.copies_within(self.chunk.offset, self.chunk.offset + self.chunk.length)

    def copies_within(self, lo: int, hi: int) -> list[tuple[int, Block]]:
        """The copies of the selected bytes in data-section bytes [lo, hi) of this chunk."""
        ends = [region.end for _, region in self.regions]  # increasing: tensors do not overlap
        out = []
        for position, region in self.regions[bisect.bisect_right(ends, lo):]:
            if region.offset >= hi:
                break
            out.extend((position, block) for block in blocks_within(region, lo, hi))
        return out


@dataclass(frozen=True)
class SelectionPlan:
    tensors: tuple[SelectedTensor, ...]  # in data-section order
    steps: tuple[ChunkStep, ...]  # the touched chunks, in data-section order
    buffer_bytes: int  # one buffer holding every selected tensor at its target_offset

    @property
    def selected_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def touched_bytes(self) -> int:
        return sum(step.chunk.length for step in self.steps)

    def windows(self, limit: int) -> list[list[ChunkStep]]:
        """The steps grouped into runs of adjacent chunks of at most ``limit`` bytes (a single
        chunk may exceed it)."""
        groups: list[list[ChunkStep]] = []
        size = 0
        for step in self.steps:
            chunk = step.chunk
            if groups:
                last = groups[-1][-1].chunk
                if last.offset + last.length == chunk.offset and size + chunk.length <= limit:
                    groups[-1].append(step)
                    size += chunk.length
                    continue
            groups.append([step])
            size = chunk.length
        return groups


def region_of(spec: TensorSpec, part: TensorSlice | None) -> tuple[tuple[int, ...], Strided]:
    """(pulled shape, where its bytes are) for ``spec`` cut by ``part``."""
    if part is None:
        return spec.shape, _strided(spec.offset, 1, spec.nbytes, spec.nbytes)
    ndim = len(spec.shape)
    if ndim == 0:
        raise FormatError(f"tensor {spec.name!r} is a scalar: it has no dimension to slice (select it whole with None)")
    if not -ndim <= part.dim < ndim:
        raise FormatError(f"tensor {spec.name!r} has {ndim} dimension(s) {list(spec.shape)}: "
                          f"TensorSlice(dim={part.dim}) needs dim in [{-ndim}, {ndim})")
    dim = part.dim % ndim
    size = spec.shape[dim]
    start, stop = part.bounds(size)
    inner = math.prod(spec.shape[dim + 1:]) * DTYPE_SIZES[spec.dtype]
    shape = (*spec.shape[:dim], stop - start, *spec.shape[dim + 1:])
    return shape, _strided(spec.offset + start * inner, math.prod(spec.shape[:dim]), (stop - start) * inner, size * inner)


def _strided(offset: int, runs: int, run_bytes: int, stride: int) -> Strided:
    if runs == 0 or run_bytes == 0:
        return Strided(offset, 0, 0, 0)
    if runs == 1 or run_bytes == stride:  # contiguous: one run
        return Strided(offset, 1, runs * run_bytes, runs * run_bytes)
    return Strided(offset, runs, run_bytes, stride)


def blocks_within(region: Strided, lo: int, hi: int) -> list[Block]:
    """The copies of ``region``'s bytes that lie in data-section bytes [lo, hi): at most a clipped
    first run, a block of whole runs and a clipped last run."""
    if not region.nbytes or hi <= lo:
        return []
    offset, runs, run_bytes, stride = region
    first = max(0, (lo - offset - run_bytes) // stride + 1)  # the first run ending after lo
    last = min(runs - 1, (hi - offset - 1) // stride) if hi > offset else -1  # the last run starting before hi
    if first > last:
        return []

    def clipped(k: int) -> Block | None:
        start = offset + k * stride
        a, b = max(start, lo), min(start + run_bytes, hi)
        return Block(a, 1, b - a, stride, k * run_bytes + a - start) if a < b else None

    def whole(k: int) -> bool:
        start = offset + k * stride
        return start >= lo and start + run_bytes <= hi

    if first == last:
        block = clipped(first)
        return [block] if block is not None else []
    out: list[Block] = []
    full_first = first if whole(first) else first + 1
    full_last = last if whole(last) else last - 1
    if full_first != first:
        head = clipped(first)
        if head is not None:
            out.append(head)
    if full_first <= full_last:
        out.append(Block(offset + full_first * stride, full_last - full_first + 1, run_bytes, stride, full_first * run_bytes))
    if full_last != last:
        tail = clipped(last)
        if tail is not None:
            out.append(tail)
    return out


def resolve_selection(manifest: Manifest, select: Selection) -> dict[str, Choice]:
    """name -> None | TensorSlice, checked against the manifest."""
    chosen = select(manifest) if callable(select) else select
    if isinstance(chosen, (str, bytes)):
        raise FormatError(f"a selection is a mapping name -> None | TensorSlice or a list of names, not the string {chosen!r}")
    if isinstance(chosen, Mapping):
        resolved = dict(chosen)
    else:
        try:
            resolved = dict.fromkeys(chosen)
        except TypeError:
            raise FormatError(f"a selection is a mapping name -> None | TensorSlice, a list of names or a "
                              f"callable returning one, not {type(chosen).__name__}") from None
    if not resolved:
        raise FormatError("the selection names no tensor")
    known = {spec.name for spec in manifest.tensors}
    unknown = sorted(str(name) for name in resolved if name not in known)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise FormatError(f"version {manifest.version} has no tensor {shown} (it has {len(known)} tensors)")
    for name, part in resolved.items():
        if part is not None and not isinstance(part, TensorSlice):
            raise FormatError(f"selection of {name!r}: expected None (whole) or a TensorSlice, not {part!r}")
    return resolved


def plan_selection(manifest: Manifest, select: Selection) -> SelectionPlan:
    resolved = resolve_selection(manifest, select)
    tensors: list[SelectedTensor] = []
    buffer_bytes = 0
    for spec in sorted(manifest.tensors, key=lambda t: t.offset):
        if spec.name not in resolved:
            continue
        shape, region = region_of(spec, resolved[spec.name])
        buffer_bytes += -buffer_bytes % TARGET_ALIGN
        tensors.append(SelectedTensor(spec, resolved[spec.name], shape, region, buffer_bytes))
        buffer_bytes += region.nbytes
    return SelectionPlan(tuple(tensors), chunk_steps(manifest.chunks, [t.region for t in tensors]), buffer_bytes)


def chunk_steps(chunks: Sequence[ChunkSpec], regions: Sequence[Strided]) -> tuple[ChunkStep, ...]:
    """Per chunk that holds selected bytes: the regions with bytes in it, in data-section order."""
    starts = [c.offset for c in chunks]
    touching: dict[int, list[tuple[int, Strided]]] = {}
    for position, region in enumerate(regions):
        if not region.nbytes:
            continue
        i = max(0, bisect.bisect_right(starts, region.offset) - 1)
        while i < len(chunks) and chunks[i].offset < region.end:
            if blocks_within(region, chunks[i].offset, chunks[i].offset + chunks[i].length):
                touching.setdefault(i, []).append((position, region))
            i += 1
    return tuple(ChunkStep(chunks[i], tuple(touching[i])) for i in sorted(touching))


def copy_blocks(copies: Iterable[tuple[int, Block]], source: np.ndarray, source_start: int,
                targets: Sequence[np.ndarray]) -> None:
    """Run the copies: ``source`` (bytes) holds the data section from offset ``source_start`` on;
    ``targets[position]`` is the flat byte buffer of the tensor at that position."""
    for position, block in copies:
        begin = block.source - source_start
        target = targets[position][block.target:block.target + block.rows * block.row_bytes]
        if block.rows == 1:
            np.copyto(target, source[begin:begin + block.row_bytes])
        else:
            rows = np.lib.stride_tricks.as_strided(source[begin:], (block.rows, block.row_bytes),
                                                   (block.stride, source.strides[0]), writeable=False)
            np.copyto(target.reshape(block.rows, block.row_bytes), rows)


def window_lease(lease: PullLease, chunks: Sequence[ChunkSpec]) -> PullLease:
    """A lease on adjacent ``chunks`` only, as if they were a whole version: its data section
    starts at the first chunk (offsets rebased to 0, ``data_offset`` moved on by as much), chunk
    indexes unchanged. A transport that pulls ``lease.manifest.chunks`` by index, at
    ``data_offset + offset``, pulls just these."""
    start = chunks[0].offset
    rebased = tuple(replace(c, offset=c.offset - start) for c in chunks)
    if any(b.offset != a.offset + a.length for a, b in zip(rebased, rebased[1:], strict=False)):
        raise ValueError("a window is adjacent chunks")
    manifest = replace(lease.manifest, tensors=(), chunks=rebased, data_offset=lease.manifest.data_offset + start)
    return replace(lease, manifest=manifest)
