"""The shm copy path over many small pieces: whatever the split of the caller's side into pieces
(one buffer, a table of small tensors) and however it is aligned to the slot, every byte lands in
place and the checksum is the one of the whole range, push after push into or out of the same
buffers; small chunks are batched without losing or reordering one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.transports.checksums import ChunkHasher, checksum_of
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import (
    ALIGNED_PIECE_BYTES,
    COPY_ALIGNMENT,
    PIECE_BYTES,
    batches_of,
    copy_window_bytes,
    gather_and_hash,
    scatter_and_hash,
)


def split(buffer: np.ndarray, cuts: list[int]) -> list[memoryview]:
    points = sorted({min(c, len(buffer)) for c in cuts} | {0, len(buffer)})
    return [memoryview(buffer[a:b]) for a, b in zip(points, points[1:], strict=False) if b > a]


sizes = st.integers(1, 3 * PIECE_BYTES + 17)
cut_lists = st.lists(st.integers(0, 3 * PIECE_BYTES + 17), max_size=40)


def aligned(size: int, shift: int) -> np.ndarray:
    """``size`` bytes starting ``shift`` bytes past a ``COPY_ALIGNMENT`` boundary."""
    raw = np.zeros(size + 2 * COPY_ALIGNMENT, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % COPY_ALIGNMENT + shift
    return raw[start:start + size]


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3 * PIECE_BYTES + 17), source_cuts=cut_lists, start=st.integers(0, 3 * PIECE_BYTES),
       source_shift=st.integers(0, COPY_ALIGNMENT - 1), target_shift=st.integers(0, COPY_ALIGNMENT - 1),
       algorithm=st.sampled_from(["xxh3_64", "crc32"]), seed=st.integers(0, 2**32 - 1))
def test_a_push_gathers_every_byte_of_its_range_and_hashes_them_again_after_the_buffers_change(
        size: int, source_cuts: list[int], start: int, source_shift: int, target_shift: int, algorithm: str,
        seed: int) -> None:
    """The pieces' cut into windows is kept across pushes: the next push copies and hashes the
    buffers' new bytes, not the first push's."""
    rng = np.random.default_rng(seed)
    source = aligned(size, source_shift)
    regions = ByteRegions([(7 + offset, view) for offset, view in _at_offsets(split(source, source_cuts))], 7 + size)
    start = min(start, size - 1)
    for _ in range(2):
        source[:] = rng.integers(0, 256, size, dtype=np.uint8)
        target = aligned(size - start, target_shift)
        checksum = gather_and_hash(target, regions, 7 + start, algorithm)
        assert np.array_equal(target, source[start:])
        assert checksum == checksum_of(algorithm, [memoryview(source[start:])])


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 3 * PIECE_BYTES + 17), target_cuts=cut_lists, start=st.integers(0, 3 * PIECE_BYTES),
       source_shift=st.integers(0, COPY_ALIGNMENT - 1), target_shift=st.integers(0, COPY_ALIGNMENT - 1),
       seed=st.integers(0, 2**32 - 1))
def test_a_pull_scatters_every_byte_of_its_range_into_the_same_buffers_again(
        size: int, target_cuts: list[int], start: int, source_shift: int, target_shift: int, seed: int) -> None:
    """The buffers' cut into windows is kept across pulls: each pull lands its own bytes in them,
    and the hash is the one of the bytes pulled."""
    rng = np.random.default_rng(seed)
    target = aligned(size, target_shift)
    regions = ByteRegions([(7 + offset, view) for offset, view in _at_offsets(split(target, target_cuts))], 7 + size)
    start = min(start, size - 1)
    for _ in range(2):
        source = aligned(size - start, source_shift)
        source[:] = rng.integers(0, 256, size - start, dtype=np.uint8)
        checksum = scatter_and_hash(source, regions, 7 + start, ChunkHasher("xxh3_64"))
        assert np.array_equal(target[start:], source)
        assert checksum == checksum_of("xxh3_64", [memoryview(source)])
        assert scatter_and_hash(source, regions, 7 + start, None) is None


def _at_offsets(views: list[memoryview]) -> list[tuple[int, memoryview]]:
    out, offset = [], 0
    for view in views:
        out.append((offset, view))
        offset += len(view)
    return out


def test_the_short_copy_step_only_where_every_byte_keeps_its_alignment() -> None:
    def regions(pieces: list[memoryview], offset: int = 0) -> ByteRegions:
        return ByteRegions([(offset + at, view) for at, view in _at_offsets(pieces)], offset + sum(map(len, pieces)))

    source, target = aligned(4 * COPY_ALIGNMENT, 0), aligned(4 * COPY_ALIGNMENT, 0)
    assert copy_window_bytes(target, regions([memoryview(source)]), 0) == ALIGNED_PIECE_BYTES
    # the pieces' boundaries fall anywhere: what counts is where each byte lands
    assert copy_window_bytes(target, regions(split(source, [3, 70, 128])), 0) == ALIGNED_PIECE_BYTES
    # the same bytes further into the data section: aligned when the whole is shifted the same
    assert copy_window_bytes(target[16:], regions(split(source[16:], [5])), 16 + 4096) == PIECE_BYTES
    assert copy_window_bytes(target[16:], regions(split(source[16:], [5]), 4096), 4096) == ALIGNED_PIECE_BYTES
    shifted = aligned(4 * COPY_ALIGNMENT, 16)
    assert copy_window_bytes(shifted, regions([memoryview(source)]), 0) == PIECE_BYTES
    # one piece out of step is enough
    assert copy_window_bytes(target, regions([memoryview(source[:64]), memoryview(shifted[64:])]), 0) == PIECE_BYTES


@given(lengths=st.lists(st.integers(1, 10 << 20), min_size=1, max_size=200), batch=st.integers(1, 8 << 20))
def test_batches_keep_every_chunk_in_order_and_hold_at_least_a_batch(lengths: list[int], batch: int) -> None:
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()
    chunks = [ChunkSpec(i, int(o), n) for i, (o, n) in enumerate(zip(offsets, lengths, strict=True))]
    batches = batches_of(chunks, batch)
    assert [c for b in batches for c in b] == chunks
    assert all(sum(c.length for c in b) >= batch for b in batches[:-1])
    assert all(sum(c.length for c in b[:-1]) < batch for b in batches)  # nothing joins a full batch
