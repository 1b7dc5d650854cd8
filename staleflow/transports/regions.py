"""Byte regions: a version's data section mapped onto in-memory buffers, and the range helpers
the transports and the parameter server cut it with."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from staleflow.transports.errors import FormatError
from staleflow.transports.layout import ChunkSpec, TensorSpec


class ByteRegions:
    """The data section of one version mapped onto in-memory buffers: one flat buffer, or one
    buffer per tensor (the caller's arrays, zero-copy). Transports write pulled bytes into it and
    read pushed bytes from it by data-section offset."""

    def __init__(self, spans: Sequence[tuple[int, memoryview]], total_bytes: int):
        self._starts = [start for start, _ in spans]
        self._views = [view for _, view in spans]
        self.total_bytes = total_bytes
        self._windows: dict[tuple[int, int, int], list[tuple[int, list[np.ndarray]]]] = {}
        self._phases: dict[int, int | None] = {}

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

    def windows(self, offset: int, length: int, window: int) -> list[tuple[int, list[np.ndarray]]]:
        """Data-section bytes [offset, offset + length) cut into windows of ``window`` bytes (the
        last one shorter): (start relative to ``offset``, the buffers' bytes covering it, as byte
        arrays). Kept per (offset, length, window): a pusher that holds the same buffers version
        after version (and so the same ``ByteRegions``) cuts its chunks once, not once per push."""
        key = (offset, length, window)
        cut = self._windows.get(key)
        if cut is None:
            cut = self._windows[key] = list(cut_windows([np.frombuffer(v, np.uint8) for v in self.views(offset, length)],
                                                        window))
        return cut

    def phase(self, alignment: int) -> int | None:
        """(a buffer's address - its data-section offset) modulo ``alignment``, when every buffer
        agrees (0 for none), else None: a target at a data-section offset is then mutually aligned
        with every byte of the regions where its own address - offset has the same phase."""
        if alignment not in self._phases:
            phases = {(address_of(np.frombuffer(view, np.uint8)) - start) % alignment
                      for start, view in zip(self._starts, self._views, strict=True) if len(view)}
            self._phases[alignment] = phases.pop() if len(phases) == 1 else (0 if not phases else None)
        return self._phases[alignment]

    def gather(self, spans: Iterable[tuple[int, int]]) -> list[memoryview]:
        """The pieces of buffers covering each (offset, length) span in turn."""
        return [view for offset, length in spans for view in self.views(offset, length)]


def _byte_view(buffer: Any) -> memoryview:
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise FormatError("arrays must be C-contiguous; call np.ascontiguousarray first")
        return buffer.reshape(-1).view(np.uint8).data
    view = memoryview(buffer)
    if not view.contiguous:
        raise FormatError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def address_of(array: np.ndarray) -> int:
    """The address of an array's first byte."""
    return array.__array_interface__["data"][0]


def cut_windows(pieces: Sequence[np.ndarray], window: int) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(offset in the concatenated pieces, the pieces' parts covering it) per window of ``window``
    bytes (the last one shorter): small pieces grouped, large ones cut."""
    parts: list[np.ndarray] = []
    filled = start = position = 0
    for array in pieces:
        taken = 0
        while taken < len(array):
            n = min(window - filled, len(array) - taken)
            parts.append(array[taken:taken + n] if n < len(array) else array)
            taken += n
            filled += n
            if filled == window:
                yield start, parts
                position += filled
                parts, filled, start = [], 0, position
    if parts:
        yield start, parts


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-overlapping byte ranges in offset order, the ones that touch joined into one."""
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(r for r in ranges if r[1] > 0):
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    return merged


def pieces_of(chunk: ChunkSpec, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) sub-ranges of a chunk, each at most ``piece_bytes``."""
    end = chunk.offset + chunk.length
    for offset in range(chunk.offset, end, piece_bytes):
        yield offset, min(piece_bytes, end - offset)
