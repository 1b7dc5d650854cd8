"""Selected pulls' byte arithmetic: a tensor-parallel slice's shape and bytes equal numpy's and
torch's split of the same tensor, whatever the shape, dtype, dim, part count and chunk size, and
a selection touches exactly the chunks that hold its bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.errors import ErrorCode
from staleflow.transports.dtypes import numpy_dtype
from staleflow.transports.errors import FormatError
from staleflow.transports.layout import Manifest, layout_tensors, plan_chunks
from staleflow.transports.selection import (
    Strided,
    TensorSlice,
    blocks_within,
    copy_blocks,
    plan_selection,
    region_of,
    select_prefix,
    select_where,
)

DTYPES = ["U8", "F16", "BF16", "F32", "I64"]


def manifest_of(tensors: dict[str, tuple[str, tuple[int, ...]]], chunk_bytes: int) -> Manifest:
    laid = layout_tensors([(name, dtype, shape) for name, (dtype, shape) in tensors.items()])
    total = sum(t.nbytes for t in laid)
    return Manifest(1, tuple(laid), tuple(plan_chunks(total, chunk_bytes)), chunk_bytes, 0)


def data_section(manifest: Manifest, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, manifest.total_bytes, dtype=np.uint8)


def stored(manifest: Manifest, data: np.ndarray, name: str) -> np.ndarray:
    spec = next(t for t in manifest.tensors if t.name == name)
    return data[spec.offset:spec.offset + spec.nbytes].view(numpy_dtype(spec.dtype)).reshape(spec.shape)


def gather(manifest: Manifest, data: np.ndarray, select: object, piece_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The selection's tensors, copied chunk by chunk (and piece by piece) as the transports do."""
    plan = plan_selection(manifest, select)
    targets = [np.full(t.nbytes, 0xEE, np.uint8) for t in plan.tensors]
    for step in plan.steps:
        chunk = step.chunk
        if piece_bytes is None:
            copy_blocks(step.copies, data[chunk.offset:chunk.offset + chunk.length], chunk.offset, targets)
        else:
            for lo in range(chunk.offset, chunk.offset + chunk.length, piece_bytes):
                hi = min(lo + piece_bytes, chunk.offset + chunk.length)
                copy_blocks(step.copies_within(lo, hi), data[lo:hi], lo, targets)
    return {t.name: target.view(numpy_dtype(t.spec.dtype)).reshape(t.shape) if t.nbytes else np.empty(t.shape)
            for t, target in zip(plan.tensors, targets, strict=True)}


shapes = st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple)


@st.composite
def sliced_tensors(draw: st.DrawFn) -> tuple[tuple[int, ...], str, TensorSlice]:
    shape = draw(shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    count = draw(st.integers(1, 9))
    return shape, draw(st.sampled_from(DTYPES)), TensorSlice(dim, draw(st.integers(0, count - 1)), count)


@settings(max_examples=300, deadline=None)
@given(sliced_tensors(), st.integers(1, 9))
def test_a_slice_is_numpys_array_split_and_torchs_tensor_split(case: tuple, parts: int) -> None:
    shape, dtype, part = case
    manifest = manifest_of({"before": ("U8", (3,)), "w": (dtype, shape), "after": ("F32", (2,))}, chunk_bytes=1 << 20)
    data = data_section(manifest, 0)
    whole = stored(manifest, data, "w")
    expected = np.array_split(whole, part.count, axis=part.dim)[part.index]
    got = gather(manifest, data, {"w": part})["w"]
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()
    as_torch = torch.from_numpy(whole.view(np.uint8) if whole.dtype.itemsize == 1 else whole.view(f"i{whole.dtype.itemsize}"))
    torch_part = torch.tensor_split(as_torch, part.count, dim=part.dim)[part.index]
    assert tuple(torch_part.shape) == expected.shape
    assert torch_part.contiguous().numpy().tobytes() == expected.tobytes()


@settings(max_examples=300, deadline=None)
@given(st.lists(sliced_tensors(), min_size=1, max_size=4), st.integers(1, 300), st.none() | st.integers(1, 40), st.data())
def test_chunk_by_chunk_copies_of_several_tensors_equal_their_slices(cases: list, chunk_bytes: int, piece_bytes: int | None,
                                                                     data: st.DataObject) -> None:
    tensors = {f"t{i}": (dtype, shape) for i, (shape, dtype, _) in enumerate(cases)}
    manifest = manifest_of(tensors, chunk_bytes)
    section = data_section(manifest, chunk_bytes)
    choices = {f"t{i}": data.draw(st.sampled_from([part, None])) for i, (_, _, part) in enumerate(cases)}
    select = data.draw(st.lists(st.sampled_from(sorted(choices)), min_size=1, unique=True))
    got = gather(manifest, section, {name: choices[name] for name in select}, piece_bytes)
    assert set(got) == set(select)
    for name in select:
        whole = stored(manifest, section, name)
        part = choices[name]
        expected = whole if part is None else np.array_split(whole, part.count, axis=part.dim)[part.index]
        assert got[name].shape == expected.shape and got[name].tobytes() == expected.tobytes(), name


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 50), st.integers(0, 6), st.integers(1, 8), st.integers(0, 8), st.integers(0, 120), st.integers(0, 120))
def test_blocks_within_a_window_are_exactly_the_selected_bytes_in_it(offset: int, runs: int, run_bytes: int, gap: int,
                                                                      lo: int, width: int) -> None:
    region = Strided(offset, runs, run_bytes, run_bytes + gap)
    selected = {offset + k * region.stride + b for k in range(runs) for b in range(run_bytes)}
    order = sorted(selected)
    covered: dict[int, int] = {}  # data-section byte -> position in the tensor's selected bytes
    for block in blocks_within(region, lo, lo + width):
        assert block.rows >= 1 and block.row_bytes >= 1
        for r in range(block.rows):
            for b in range(block.row_bytes):
                byte = block.source + r * block.stride + b
                assert byte not in covered
                covered[byte] = block.target + r * block.row_bytes + b
    assert set(covered) == {b for b in selected if lo <= b < lo + width}
    assert all(order.index(byte) == target for byte, target in covered.items())


@settings(max_examples=200, deadline=None)
@given(sliced_tensors(), st.integers(1, 64))
def test_the_touched_chunks_are_those_holding_selected_bytes(case: tuple, chunk_bytes: int) -> None:
    shape, dtype, part = case
    manifest = manifest_of({"a": ("U8", (5,)), "w": (dtype, shape), "z": ("U8", (5,))}, chunk_bytes)
    plan = plan_selection(manifest, {"w": part})
    region = plan.tensors[0].region
    selected = {region.offset + k * region.stride + b for k in range(region.runs) for b in range(region.run_bytes)}
    expected = [c.index for c in manifest.chunks if any(c.offset <= b < c.offset + c.length for b in selected)]
    assert [step.chunk.index for step in plan.steps] == expected
    assert plan.selected_bytes == len(selected) == math.prod(plan.tensors[0].shape) * numpy_dtype(dtype).itemsize


def test_uneven_splits_give_the_first_parts_one_more() -> None:
    assert [TensorSlice(0, i, 4).bounds(10) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [TensorSlice(0, i, 4).bounds(2) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]  # empty parts
    assert [TensorSlice(1, i, 2).bounds(8) for i in range(2)] == [(0, 4), (4, 8)]  # even: vLLM's split
    manifest = manifest_of({"w": ("F32", (4, 6))}, 16)
    shape, region = region_of(manifest.tensors[0], TensorSlice(-1, 1, 4))  # columns 2..3 of each row
    assert shape == (4, 2) and region == Strided(2 * 4, 4, 2 * 4, 6 * 4)
    shape, region = region_of(manifest.tensors[0], TensorSlice(0, 1, 2))  # rows 2..3: one contiguous run
    assert shape == (2, 6) and region == Strided(2 * 6 * 4, 1, 2 * 6 * 4, 2 * 6 * 4)


def test_windows_group_adjacent_touched_chunks_up_to_the_limit() -> None:
    manifest = manifest_of({"a": ("U8", (40,)), "b": ("U8", (40,)), "c": ("U8", (40,))}, 10)
    plan = plan_selection(manifest, ["a", "c"])
    assert [[s.chunk.index for s in w] for w in plan.windows(30)] == [[0, 1, 2], [3], [8, 9, 10], [11]]
    assert [[s.chunk.index for s in w] for w in plan.windows(5)] == [[i] for i in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert plan.touched_bytes == 80 and plan.selected_bytes == 80


def test_prefix_and_predicate_selections_resolve_against_the_manifest() -> None:
    manifest = manifest_of({"layers.0.w": ("F32", (4, 4)), "layers.0.norm": ("F32", (4,)), "layers.1.w": ("F32", (4, 4)),
                            "embed": ("F32", (8, 4))}, 32)
    plan = plan_selection(manifest, select_prefix("layers.0."))
    assert [t.name for t in plan.tensors] == ["layers.0.w", "layers.0.norm"]
    column = TensorSlice(0, 1, 2)
    plan = plan_selection(manifest, select_where(lambda spec: spec.name.endswith(".w"),
                                                 part=lambda spec: column if len(spec.shape) == 2 else None))
    assert [(t.name, t.shape) for t in plan.tensors] == [("layers.0.w", (2, 4)), ("layers.1.w", (2, 4))]
    plan = plan_selection(manifest, select_prefix("layers.", part=column))
    assert [t.shape for t in plan.tensors] == [(2, 4), (2,), (2, 4)]
    with pytest.raises(FormatError, match="no tensor of version 1 matches"):
        plan_selection(manifest, select_prefix("decoder."))


@pytest.mark.parametrize(("select", "message"), [
    ({"nope": None}, "has no tensor 'nope'"),
    ({"w": TensorSlice(2, 0, 2)}, r"TensorSlice\(dim=2\) needs dim in \[-2, 2\)"),
    ({"w": TensorSlice(-3, 0, 2)}, "needs dim in"),
    ({"s": TensorSlice(0, 0, 1)}, "is a scalar"),
    ({"w": (0, 0, 2)}, "expected None .whole. or a TensorSlice"),
    ({}, "names no tensor"),
    ("w", "not the string 'w'"),
    (42, "not int"),
])
def test_bad_selections_are_format_errors_with_a_clear_message(select: object, message: str) -> None:
    manifest = manifest_of({"w": ("F32", (4, 6)), "s": ("F32", ())}, 16)
    with pytest.raises(FormatError, match=message) as refused:
        plan_selection(manifest, select)
    assert refused.value.code is ErrorCode.INVALID_FORMAT


@pytest.mark.parametrize(("args", "message"), [
    ((0, 0, 0), "count must be at least 1"),
    ((0, 2, 2), r"index must be in \[0, 2\)"),
    ((0, -1, 2), r"index must be in \[0, 2\)"),
    ((0.5, 0, 2), "dim must be an integer"),
    ((0, True, 2), "index must be an integer"),
])
def test_bad_slices_are_refused_when_made(args: tuple, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        TensorSlice(*args)
