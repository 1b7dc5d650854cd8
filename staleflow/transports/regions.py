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
        return buffer.reshape(-1).view(np.uint8).data
    view = memoryview(buffer)
    if not view.contiguous:
        raise FormatError("buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


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
