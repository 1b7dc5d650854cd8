"""Real architectures' tensor tables through the parameter server: a MoE table of thousands of
small tensors, a tied model, every floating dtype, pushed by FSDP-split ranks and pulled back
byte for byte; many small tensors cost no more chunks than one tensor of the same bytes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.dtypes import DTYPE_SIZES
from staleflow.transports.errors import FormatError
from staleflow.transports.staging import FlatStaging
from staleflow.transports.tables import fsdp_shard_ranges, model_tensor_table, table_bytes

CHUNK = 1 << 20

TINY_MOE = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 128, "num_experts_per_tok": 2, "tie_word_embeddings": False}
TINY_TIED = {"model_type": "qwen2", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=CHUNK, fsync=False, keep=2)
    with serve_in_thread(create_app(config)) as server:
        yield server.url


def random_weights(table: dict, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, dtype=torch.float32).to(TORCH_DTYPES[dtype])
            for name, (dtype, shape) in table.items()}


def rank_share(weights: dict[str, torch.Tensor], table: dict, rank: int, ranks: int) -> list[ShardPiece]:
    """Rank ``rank``'s FSDP dim-0 shards, as byte views of the full tensors."""
    flat = {name: tensor.reshape(-1).view(torch.uint8) for name, tensor in weights.items()}
    return [ShardPiece(name, start, flat[name][start:start + n]) for name, start, n in fsdp_shard_ranges(table, rank, ranks)]


def push_from_ranks(client_url: str, version: int, table: dict, weights: dict, ranks: int, transport: str) -> None:
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            with ParamsClient(client_url) as client:
                reply = client.push_part(version, rank, ranks, table, rank_share(weights, table, rank, ranks),
                                         transport=transport, wait_s=30)
                assert reply["visible"]
        except BaseException as exc:  # reported below, on the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_a_moe_table_names_every_expert_and_shards_like_fsdp() -> None:
    table = model_tensor_table(TINY_MOE)
    experts = [name for name in table if ".mlp.experts." in name]
    assert len(experts) == 4 * 128 * 3  # gate, up, down per expert per layer
    assert table["model.layers.0.mlp.experts.127.down_proj.weight"] == ("BF16", (64, 16))
    assert table["model.layers.0.mlp.experts.0.gate_proj.weight"] == ("BF16", (16, 64))
    for ranks in (1, 3, 4):
        covered: dict[str, int] = {}
        for rank in range(ranks):
            for name, start, n in fsdp_shard_ranges(table, rank, ranks):
                assert start == covered.get(name, 0)  # ranks' shards follow each other, torch.chunk's split
                covered[name] = start + n
        assert covered == {name: int(np.prod(shape)) * DTYPE_SIZES[dtype] for name, (dtype, shape) in table.items()}


def test_a_tied_model_pushes_its_embedding_once() -> None:
    table = model_tensor_table(TINY_TIED, "fp32")
    assert "lm_head.weight" not in table and table["model.embed_tokens.weight"] == ("F32", (320, 32))
    untied = model_tensor_table({**TINY_TIED, "tie_word_embeddings": False}, "fp32")
    assert table_bytes(untied) - table_bytes(table) == 320 * 32 * 4


def test_a_config_that_is_not_a_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no such file"):
        model_tensor_table(tmp_path / "missing")
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(FormatError, match="model_type"):
        model_tensor_table(tmp_path)
    with pytest.raises(FormatError, match="use bf16, fp16 or fp32"):
        model_tensor_table(TINY_TIED, "int3")


@pytest.mark.parametrize(("transport", "ranks"), [("shm", 1), ("shm", 3), ("http", 1), ("http", 2)])
def test_a_moe_table_pushed_by_fsdp_ranks_pulls_back_byte_for_byte(url: str, transport: str, ranks: int) -> None:
    table = model_tensor_table(TINY_MOE)
    assert len(table) > 1500
    weights = random_weights(table, seed=ranks)
    push_from_ranks(url, 1, table, weights, ranks, transport)
    with ParamsClient(url) as client:
        pulled = client.pull(1, transport, as_torch=True)
        assert list(pulled) == list(table)
        assert all(torch.equal(pulled[name], weights[name]) for name in table)
        # out= into the engine's own (per-tensor) buffers
        engine = {name: torch.empty_like(tensor) for name, tensor in weights.items()}
        client.pull(1, transport, out=engine)
        assert all(torch.equal(engine[name], weights[name]) for name in table)


def test_one_rank_of_many_small_tensors_makes_no_more_chunks_than_their_bytes_need(url: str) -> None:
    table = model_tensor_table(TINY_MOE)
    weights = random_weights(table, seed=7)
    push_from_ranks(url, 1, table, weights, 1, "shm")
    with ParamsClient(url) as client:
        manifest = client.manifest(1)
    assert len(manifest.chunks) == -(-table_bytes(table) // CHUNK)  # not one per tensor
    assert [(c.offset, c.length) for c in manifest.chunks] == [
        (o, min(CHUNK, table_bytes(table) - o)) for o in range(0, table_bytes(table), CHUNK)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_floating_dtype_round_trips_exactly(url: str, dtype: str) -> None:
    table = model_tensor_table(TINY_TIED, dtype)
    weights = random_weights(table, seed=3)
    # values a lossy conversion would change: extremes, subnormals, signed zero, non-finite
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 65504.0, -3.0e38])
    first = next(iter(weights))
    weights[first].view(-1)[:len(special)] = special.to(weights[first].dtype)
    with ParamsClient(url) as client:
        client.push(1, weights)
        pulled = client.pull(1, "auto", as_torch=True)
    for name, tensor in weights.items():
        assert pulled[name].dtype == tensor.dtype
        assert torch.equal(pulled[name].view(torch.uint8), tensor.view(torch.uint8))  # bits, NaN included


def test_staged_pull_into_one_flat_buffer_loads_the_engine_tensors(url: str) -> None:
    """An engine's parameters behind one staging buffer: the pull lands in it as one region and
    one scatter loads every tensor."""
    table = model_tensor_table(TINY_MOE)
    weights = random_weights(table, seed=11)
    push_from_ranks(url, 1, table, weights, 2, "shm")
    engine = [torch.zeros_like(weights[name]) for name in table]
    staging = FlatStaging(engine)
    with ParamsClient(url) as client:
        for transport in ("shm", "http"):
            for tensor in engine:
                tensor.zero_()
            client.pull(1, transport, into=staging.host)
            staging.to_device()
            assert all(torch.equal(tensor, weights[name]) for tensor, name in zip(engine, table, strict=True))
        with pytest.raises(FormatError, match="data section has"):
            client.pull(1, "shm", into=staging.host[:-2])


def test_staged_shards_push_from_one_host_buffer(url: str) -> None:
    """A rank's device shards gathered into one staging buffer, pushed from views of it."""
    table = model_tensor_table(TINY_MOE)
    weights = random_weights(table, seed=5)
    ranks = 2
    for rank in range(ranks):
        ranges = fsdp_shard_ranges(table, rank, ranks)
        flat = {name: tensor.reshape(-1).view(torch.uint8) for name, tensor in weights.items()}
        staging = FlatStaging([flat[name][start:start + n].clone() for name, start, n in ranges])
        staging.to_host()
        host = staging.host
        pieces = [ShardPiece(name, start, host[offset:offset + n])
                  for (name, start, n), offset in zip(ranges, staging.offsets, strict=True)]
        with ParamsClient(url) as client:
            reply = client.push_part(1, rank, ranks, table, pieces, transport="shm")
        assert reply["visible"] == (rank == ranks - 1)
    with ParamsClient(url) as client:
        pulled = client.pull(1, "shm", as_torch=True)
    assert all(torch.equal(pulled[name], weights[name]) for name in table)
