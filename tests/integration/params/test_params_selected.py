"""Selected pulls against a real parameter server on loopback, over shm and http: only some
tensors, each whole or one tensor-parallel slice, equal to the same slice of the whole pull;
every chunk the selected bytes come from is verified; bad selections and buffers are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.base import PullLease
from staleflow.transports.client import ParamsClient, RawTensor
from staleflow.transports.errors import ChecksumMismatch, FormatError
from staleflow.transports.nixl import nixl_available
from staleflow.transports.selection import TensorSlice, select_prefix

CHUNK = 64 << 10
TRANSPORTS = ["http", "shm"]  # both read the PS's memory slot, where corrupt_slot flips a byte
# a byte flipped behind the PS's back is found by hashing: over shm only when the puller asks for it
HASHED = {"verify": "checksum"}
NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available()[0], reason=nixl_available()[1]))


def state_dict(seed: int) -> dict[str, object]:
    """~0.8 MB over 13 chunks: tensors spanning several chunks, uneven splits, mixed dtypes."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((301, 128)).astype(np.float32),
        "layers.0.qkv": rng.integers(-(2**15), 2**15, (96, 520), dtype=np.int16),
        "layers.0.o_proj": rng.standard_normal((256, 300)).astype(np.float32),
        "layers.0.norm": rng.standard_normal(7).astype(np.float16),
        "layers.0.bf16": RawTensor("BF16", (33, 10, 3), rng.integers(0, 2**16, 990, dtype=np.uint16).tobytes()),
        "layers.1.mask": rng.integers(0, 2, (5, 11)).astype(np.bool_),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.array(seed * 0.5),
    }


def tensor_parallel(rank: int, size: int) -> dict[str, TensorSlice | None]:
    """What one rank of a ``size``-way tensor-parallel engine loads: column-parallel weights cut
    along dim 0, row-parallel along dim 1, norms whole."""
    return {
        "embed.weight": TensorSlice(0, rank, size),
        "layers.0.qkv": TensorSlice(0, rank, size),
        "layers.0.o_proj": TensorSlice(1, rank, size),
        "layers.0.norm": None,
        "layers.0.bf16": TensorSlice(-1, rank, size),
        "layers.1.mask": TensorSlice(1, rank, size),
        "empty": TensorSlice(0, rank, size),
    }


def expected_part(whole: np.ndarray, part: TensorSlice | None) -> np.ndarray:
    return whole if part is None else np.array_split(whole, part.count, axis=part.dim)[part.index]


def assert_selected(got: dict[str, object], whole: dict[str, np.ndarray], select: dict[str, TensorSlice | None]) -> None:
    assert set(got) == set(select)
    for name, part in select.items():
        expected = expected_part(whole[name], part)
        value = np.asarray(got[name])
        assert value.shape == expected.shape and value.dtype == expected.dtype, name
        assert value.tobytes() == expected.tobytes(), name


@pytest.fixture
def ps(tmp_path: Path, transport: str) -> Iterator[ParamsClient]:
    transports = ("http", "shm", "nixl") if transport == "nixl" else ("http", "shm")
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=CHUNK, fsync=False, keep=2, transports=transports)
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        client.push(1, state_dict(1))
        yield client


def corrupt_slot(ps: ParamsClient, data_section_offset: int) -> None:
    """Flip one byte of version 1 in the PS's memory slot (which http pulls are served from too)."""
    lease = ps.open_pull(1, "shm")
    ps.close_pull(lease)
    with open(lease.details["path"], "r+b") as slot:
        slot.seek(lease.manifest.data_offset + data_section_offset)
        byte = slot.read(1)[0]
        slot.seek(lease.manifest.data_offset + data_section_offset)
        slot.write(bytes([byte ^ 0xFF]))


def byte_of(lease: PullLease, name: str, row: int, column_byte: int) -> int:
    """The data-section offset of byte ``column_byte`` of row ``row`` of 2-D tensor ``name``."""
    spec = next(t for t in lease.manifest.tensors if t.name == name)
    return spec.offset + row * (spec.nbytes // spec.shape[0]) + column_byte


@pytest.mark.parametrize("transport", [*TRANSPORTS, NIXL])
def test_selected_pulls_equal_the_slices_of_the_whole_pull(ps: ParamsClient, transport: str) -> None:
    whole = ps.pull(1, transport)
    for size in (1, 2, 3, 8):
        for rank in range(size):
            select = tensor_parallel(rank, size)
            assert_selected(ps.pull(1, transport, select=select), whole, select)
            assert_selected(ps.pull(1, transport, select=select, verify=False), whole, select)
    ps.selection_scratch_bytes = 1  # http, nixl: one chunk at a time through the scratch buffer
    for rank in range(3):
        select = tensor_parallel(rank, 3)
        assert_selected(ps.pull(1, transport, select=select), whole, select)
    # a list of names: those tensors whole; a prefix: one pipeline stage's tensors
    assert_selected(ps.pull(1, transport, select=["scalar", "layers.0.norm"]), whole, {"scalar": None, "layers.0.norm": None})
    stage = ps.pull(1, transport, select=select_prefix("layers.0.", part=lambda spec: TensorSlice(0, 1, 2) if spec.shape else None))
    assert_selected(stage, whole, {n: TensorSlice(0, 1, 2) for n in ("layers.0.qkv", "layers.0.o_proj", "layers.0.norm", "layers.0.bf16")})


@pytest.mark.parametrize("transport", [*TRANSPORTS, NIXL])
def test_selected_tensors_come_in_data_section_order_into_buffers_of_their_selected_shapes(ps: ParamsClient, transport: str) -> None:
    whole = ps.pull(1, transport)
    select = tensor_parallel(1, 2)
    out = {name: np.empty_like(expected_part(whole[name], part)) for name, part in select.items()}
    landed = list(ps.iter_pull(1, transport, select=select, out=out))
    assert [name for name, _ in landed] == [name for name in state_dict(1) if name in select]
    assert all(value is out[name] for name, value in landed)
    assert_selected(out, whole, select)
    # torch tensors: as buffers, and as what comes back
    torch_out = {"layers.0.o_proj": torch.empty(256, 150, dtype=torch.float32)}
    ps.pull(1, transport, select={"layers.0.o_proj": TensorSlice(1, 0, 2)}, out=torch_out)
    assert torch_out["layers.0.o_proj"].numpy().tobytes() == whole["layers.0.o_proj"][:, :150].tobytes()
    as_torch = ps.pull(1, transport, select={"layers.0.bf16": TensorSlice(2, 2, 3), "layers.0.qkv": TensorSlice(0, 0, 5)}, as_torch=True)
    assert as_torch["layers.0.bf16"].dtype == torch.bfloat16 and tuple(as_torch["layers.0.bf16"].shape) == (33, 10, 1)
    assert tuple(as_torch["layers.0.qkv"].shape) == (20, 520)
    assert as_torch["layers.0.qkv"].numpy().tobytes() == whole["layers.0.qkv"][:20].tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_corrupted_byte_in_a_selected_slice_is_detected(ps: ParamsClient, transport: str) -> None:
    lease = ps.open_pull(1, "shm")
    ps.close_pull(lease)
    select = {"layers.0.o_proj": TensorSlice(1, 1, 2)}  # the right half of each 1200-byte row
    corrupt_slot(ps, byte_of(lease, "layers.0.o_proj", 200, 900))
    with pytest.raises(ChecksumMismatch) as caught:
        ps.pull(1, transport, select=select, **HASHED)
    assert caught.value.code is ErrorCode.CHECKSUM_MISMATCH
    unverified = ps.pull(1, transport, select=select, verify=False)  # verify=False skips the hashing
    assert unverified["layers.0.o_proj"].shape == (256, 150)
    assert ps.versions().readers["leases"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_whole_chunks_are_verified_and_untouched_chunks_are_not_read(ps: ParamsClient, transport: str) -> None:
    whole = ps.pull(1, transport)
    lease = ps.open_pull(1, "shm")
    ps.close_pull(lease)
    first_rows = {"embed.weight": TensorSlice(0, 0, 6)}  # rows 0..50 of 301 (512 bytes each): in chunk 0
    # row 250 of the same tensor is in chunk 1, which this selection does not touch
    corrupt_slot(ps, byte_of(lease, "embed.weight", 250, 0))
    assert_selected(ps.pull(1, transport, select=first_rows, **HASHED), whole, first_rows)
    with pytest.raises(ChecksumMismatch) as caught:
        ps.pull(1, transport, **HASHED)  # the whole version does read it
    assert caught.value.chunk_index == 1
    # row 120 is not selected either, but it is in chunk 0: the whole chunk is verified
    corrupt_slot(ps, byte_of(lease, "embed.weight", 120, 4))
    with pytest.raises(ChecksumMismatch) as caught:
        ps.pull(1, transport, select=first_rows, **HASHED)
    assert caught.value.chunk_index == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_selections_and_buffers_are_refused_with_clear_errors(ps: ParamsClient, transport: str) -> None:
    select = {"layers.0.o_proj": TensorSlice(1, 0, 2)}

    def into(buffer: object) -> dict:
        return {"select": select, "out": {"layers.0.o_proj": buffer}}

    refusals = [
        ({"select": {"nope": None}}, "has no tensor 'nope'"),
        ({"select": {"layers.0.norm": TensorSlice(1, 0, 2)}}, "needs dim in"),
        ({"select": {"scalar": TensorSlice(0, 0, 2)}}, "is a scalar"),
        (into(np.empty((150, 256), np.float32)), r"has shape \[150, 256\]; the selection gives F32 \[256, 150\]"),
        (into(np.empty((256, 300), np.float32)), r"has shape \[256, 300\]"),
        (into(np.empty((256, 150), np.float64)), "holds 307200 bytes; the selection gives 153600"),
        (into(np.empty((256, 300), np.float32)[:, :150]), "C-contiguous"),
        ({"select": select, "out": {}}, "no buffer for the selected tensor 'layers.0.o_proj'"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(FormatError, match=message) as refused:
            ps.pull(1, transport, **kwargs)
        assert refused.value.code is ErrorCode.INVALID_FORMAT
    assert ps.versions().readers["leases"] == 0  # every refused pull gave its lease back
