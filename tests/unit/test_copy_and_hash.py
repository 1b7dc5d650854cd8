"""The shm copy path over many small pieces: whatever the split of either side into pieces (one
buffer, a table of small tensors, both), every byte lands in place and the checksum is the one of
the whole chunk; small chunks are batched without losing or reordering one."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.transports.base import ChunkSpec, checksum_of
from staleflow.transports.shm import PIECE_BYTES, batches_of, copy_and_hash


def split(buffer: np.ndarray, cuts: list[int]) -> list[memoryview]:
    points = sorted({min(c, len(buffer)) for c in cuts} | {0, len(buffer)})
    return [memoryview(buffer[a:b]) for a, b in zip(points, points[1:], strict=False) if b > a]


sizes = st.integers(1, 3 * PIECE_BYTES + 17)
cut_lists = st.lists(st.integers(0, 3 * PIECE_BYTES + 17), max_size=40)


@settings(max_examples=60, deadline=None)
@given(size=sizes, source_cuts=cut_lists, target_cuts=cut_lists, algorithm=st.sampled_from(["xxh3_64", "crc32"]),
       seed=st.integers(0, 2**32 - 1))
def test_copy_and_hash_lands_every_byte_and_hashes_the_whole_chunk(size: int, source_cuts: list[int], target_cuts: list[int],
                                                                   algorithm: str, seed: int) -> None:
    source = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    for target_cuts_used in (target_cuts, []):  # many pieces on both sides; one destination buffer
        for source_cuts_used in (source_cuts, []):
            target = np.zeros(size, np.uint8)
            checksum = copy_and_hash(split(target, target_cuts_used), split(source, source_cuts_used), algorithm)
            assert np.array_equal(target, source)
            assert checksum == checksum_of(algorithm, [memoryview(source)])


@given(lengths=st.lists(st.integers(1, 10 << 20), min_size=1, max_size=200), batch=st.integers(1, 8 << 20))
def test_batches_keep_every_chunk_in_order_and_hold_at_least_a_batch(lengths: list[int], batch: int) -> None:
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()
    chunks = [ChunkSpec(i, int(o), n) for i, (o, n) in enumerate(zip(offsets, lengths, strict=True))]
    batches = batches_of(chunks, batch)
    assert [c for b in batches for c in b] == chunks
    assert all(sum(c.length for c in b) >= batch for b in batches[:-1])
    assert all(sum(c.length for c in b[:-1]) < batch for b in batches)  # nothing joins a full batch
