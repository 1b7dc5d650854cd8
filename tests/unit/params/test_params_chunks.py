"""How the PS cuts a push into chunks and a version into its manifest's chunks: a part's small
ranges are gathered into chunks of several ranges, and the manifest is cut anew over the data
section so that many parts' small shards make about ``bytes / chunk_bytes`` chunks; every chunk
still carries the checksum of exactly its bytes."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.servers.params.rules import manifest_chunks, small_range_bytes, split_ranges
from staleflow.transports.checksums import checksum_of, chunk_checksum
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import merge_ranges


def covered(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return merge_ranges(spans)


@st.composite
def parts_tiling(draw: st.DrawFn) -> tuple[int, int, list[list[tuple[int, int]]]]:
    """(chunk_bytes, total, each part's ranges): a data section cut into tensors, each tensor's
    rows split among the parts as FSDP splits them, sometimes with a large tensor among them."""
    chunk_bytes = draw(st.sampled_from([64, 100, 256, 1000]))
    parts = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.one_of(st.integers(0, 3 * chunk_bytes), st.integers(0, chunk_bytes // 8)), min_size=1, max_size=40))
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
    offset = 0
    for size in sizes:
        share = -(-size // parts)
        for part in range(parts):
            start, end = min(size, part * share), min(size, (part + 1) * share)
            if end > start:
                ranges[part].append((offset + start, end - start))
        offset += size
    return chunk_bytes, offset, ranges


@settings(max_examples=300, deadline=None)
@given(parts_tiling(), st.booleans())
def test_a_parts_chunks_cover_its_ranges_exactly_each_at_most_a_chunk(case: tuple, gather: bool) -> None:
    chunk_bytes, _, ranges = case
    for part_ranges in ranges:
        chunks = split_ranges(part_ranges, chunk_bytes, gather)
        spans = [span for chunk in chunks for span in chunk.spans()]
        assert covered(spans) == covered(part_ranges)
        assert sum(n for _, n in spans) == sum(n for _, n in part_ranges)  # nothing twice
        assert [c.index for c in chunks] == list(range(len(chunks)))
        for chunk in chunks:
            assert 0 < chunk.length <= chunk_bytes
            assert chunk.length == sum(n for _, n in chunk.spans()) and chunk.offset == chunk.spans()[0][0]
            assert list(chunk.spans()) == sorted(chunk.spans())
            if chunk.ranges:  # only small ranges are gathered, and never one alone
                assert gather and len(chunk.ranges) > 1
                assert all(n < small_range_bytes(chunk_bytes) for _, n in chunk.ranges)
        if gather:  # one chunk per chunk_bytes of small ranges, not one per range
            small = sum(n for _, n in merge_ranges(part_ranges) if n < small_range_bytes(chunk_bytes))
            large = [n for _, n in merge_ranges(part_ranges) if n >= small_range_bytes(chunk_bytes)]
            assert len(chunks) <= 2 * math.ceil(small / chunk_bytes) + 1 + sum(-(-n // chunk_bytes) for n in large)


def delivered_chunks(data: bytes, chunk_bytes: int, ranges: list[list[tuple[int, int]]], gather: bool,
                     unknown: set[int]) -> list[tuple[ChunkSpec, str | None, list[str] | None]]:
    """Every part's chunks as a push delivers them: each with the checksum of its bytes, a
    gathered one also with its ranges' (but those of parts in ``unknown``: a pusher that handed
    in none, whose bytes the PS hashes at commit)."""
    out: list[tuple[ChunkSpec, str | None, list[str] | None]] = []
    for part, part_ranges in enumerate(ranges):
        for chunk in split_ranges(part_ranges, chunk_bytes, gather):
            if chunk.ranges and part in unknown:
                out.append((chunk, None, None))
                continue
            pieces = [data[o:o + n] for o, n in chunk.spans()]
            out.append((chunk, chunk_checksum(chunk, "crc32", pieces),
                        [checksum_of("crc32", [p]) for p in pieces] if chunk.ranges else None))
    return out


@settings(max_examples=300, deadline=None)
@given(parts_tiling(), st.booleans(), st.sets(st.integers(0, 3), max_size=2))
def test_the_manifest_tiles_the_data_section_and_every_checksum_is_its_chunks_bytes(case: tuple, gather: bool,
                                                                                    unknown: set[int]) -> None:
    chunk_bytes, total, ranges = case
    data = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8).tobytes()
    delivered = delivered_chunks(data, chunk_bytes, ranges, gather, unknown)
    chunks = manifest_chunks(delivered, chunk_bytes)
    position = 0
    for index, chunk in enumerate(chunks):  # contiguous, in order, tiling [0, total)
        assert chunk.index == index and chunk.offset == position and 0 < chunk.length <= chunk_bytes and not chunk.ranges
        position += chunk.length
    assert position == total
    unknown_spans = [span for c, x, _ in delivered if x is None for span in c.spans()]
    for chunk in chunks:  # made of the pushers' checksums, without reading a byte: the chunk's bytes'
        overlaps_unknown = any(o < chunk.offset + chunk.length and chunk.offset < o + n for o, n in unknown_spans)
        assert (chunk.checksum is None) == overlaps_unknown  # those the PS hashes at commit
        if chunk.checksum is not None:
            assert chunk.checksum == chunk_checksum(chunk, None, [data[chunk.offset:chunk.offset + chunk.length]])
            assert sum(chunk.segment_lengths()) == chunk.length
    whole = [c for c, x, _ in delivered if x is not None and not c.ranges and c.length >= small_range_bytes(chunk_bytes)]
    assert len(chunks) <= 2 * math.ceil(total / chunk_bytes) + 2 * len(whole) + 1


def test_a_corrupted_byte_fails_a_joined_chunks_checksum() -> None:
    data = bytearray(range(200)) * 50
    ranges = [[(o, 50) for o in range(part * 50, len(data), 100)] for part in range(2)]
    chunks = manifest_chunks(delivered_chunks(bytes(data), 4096, ranges, True, set()), 4096)
    assert len(chunks) == 3 and all(len(c.segments) > 1 for c in chunks)
    data[5000] ^= 1
    assert [chunk_checksum(c, None, [data[c.offset:c.offset + c.length]]) == c.checksum for c in chunks] == [True, False, True]


def test_small_shards_of_several_parts_make_about_one_chunk_per_chunk_bytes() -> None:
    """Two FSDP ranks of 1,000 small tensors: each rank's rows are 1,000 ranges, not adjacent;
    each rank pushes a few gathered chunks and the version has ``bytes / chunk_bytes`` chunks."""
    chunk_bytes, tensor, parts = 1 << 16, 1000, 2
    ranges = [[(i * tensor + part * tensor // 2, tensor // 2) for i in range(1000)] for part in range(parts)]
    per_part = [split_ranges(r, chunk_bytes, gather=True) for r in ranges]
    assert [len(c) for c in per_part] == [math.ceil(500_000 / chunk_bytes)] * parts
    assert len(split_ranges(ranges[0], chunk_bytes)) == 1000  # without gathering: one chunk per range
    delivered = [(c, None, None) for chunks in per_part for c in chunks]
    assert len(manifest_chunks(delivered, chunk_bytes)) <= math.ceil(1_000_000 / chunk_bytes) + 1


def test_a_one_part_push_keeps_its_chunks_and_their_checksums() -> None:
    chunk_bytes = 4096
    chunks = split_ranges([(0, 10_000)], chunk_bytes, gather=True)
    delivered = [(c, f"crc32:{c.index:08x}", None) for c in chunks]
    assert manifest_chunks(delivered, chunk_bytes) == [ChunkSpec(c.index, c.offset, c.length, x) for c, x, _ in delivered]
