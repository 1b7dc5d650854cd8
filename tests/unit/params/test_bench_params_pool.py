"""The pooled state dict of ``bench params``: shared buffers change no byte of what is pushed
or pulled (equal shapes hold equal bytes), so verified pulls stay valid."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.transports.bench import RING_TENSORS, engine_buffers, rank_pieces, tensor_table

TENSOR = 64 << 10


def assembled(table: dict, ranks: int, pooled: bool) -> dict[str, bytes]:
    """The version the ranks' pieces make up, tensor by tensor."""
    out = {name: bytearray(4 * shape[0] * shape[1]) for name, (_, shape) in table.items()}
    for rank in range(ranks):
        for piece in rank_pieces(table, rank, ranks, pooled):
            data = np.asarray(piece.data).tobytes()
            out[piece.name][piece.start:piece.start + len(data)] = data
    return {name: bytes(b) for name, b in out.items()}


@settings(max_examples=25, deadline=None)
@given(tensors=st.integers(1, 3 * RING_TENSORS), tail=st.sampled_from([0, 4096, 3 * 4096]), ranks=st.integers(1, 4))
def test_pooled_pieces_push_the_same_version_as_unpooled_ones(tensors: int, tail: int, ranks: int) -> None:
    table = tensor_table(tensors * TENSOR + tail * 4, TENSOR)
    assert assembled(table, ranks, pooled=True) == assembled(table, ranks, pooled=False)
    distinct = {id(p.data) for p in rank_pieces(table, 0, ranks, pooled=True)}
    assert len(distinct) <= RING_TENSORS + 1  # the ring, plus the smaller last tensor


def test_pooled_engine_buffers_share_only_same_shaped_tensors() -> None:
    table = tensor_table(20 * TENSOR + 4096 * 4, TENSOR)
    out = engine_buffers(table, pooled=True)
    assert len({id(a) for a in out.values()}) == RING_TENSORS + 1
    for name, (_, shape) in table.items():
        assert out[name].shape == shape
    names = list(table)
    assert out[names[0]] is out[names[RING_TENSORS]] and out[names[0]] is not out[names[1]]
    assert len({id(a) for a in engine_buffers(table, pooled=False).values()}) == len(table)
