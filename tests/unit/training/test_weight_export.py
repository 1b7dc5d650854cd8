"""A trainer rank's export of its share: the engine's dtype, reusable staging buffers that a live
share keeps, and the dim-0 shards of a real FSDP2 model."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from staleflow.training.export import LocalShard, ShareStaging, export_dtype, local_shards  # noqa: E402

pytestmark = pytest.mark.torch


def shards_of(state: dict[str, torch.Tensor], rank: int, ranks: int) -> list[LocalShard]:
    out = []
    for name, tensor in state.items():
        rows = -(-tensor.shape[0] // ranks)
        out.append(LocalShard(name, tuple(tensor.shape), rank * rows, tensor[rank * rows:(rank + 1) * rows]))
    return out


def test_fp32_master_weights_export_as_bf16_equal_to_the_cast() -> None:
    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(7, 5, generator=generator) * 1e3, "b": torch.randn(7, generator=generator),
             "step": torch.arange(7, dtype=torch.int64)}
    share = ShareStaging(1, 2, export_dtype("bfloat16")).export(shards_of(state, 1, 2))
    assert share.tensors == {"w": ("BF16", (7, 5)), "b": ("BF16", (7,)), "step": ("I64", (7,))}
    pieces = {p.name: p for p in share.pieces}
    assert pieces["w"].data.dtype == torch.bfloat16 and torch.equal(pieces["w"].data, state["w"][4:].to(torch.bfloat16))
    assert torch.equal(pieces["b"].data, state["b"][4:].to(torch.bfloat16))
    assert torch.equal(pieces["step"].data, state["step"][4:])  # integers keep their dtype
    assert pieces["w"].start == 4 * 5 * 2 and pieces["b"].start == 4 * 2 and pieces["step"].start == 4 * 8
    assert not torch.equal(pieces["w"].data.float(), state["w"][4:])  # the cast did round: bf16 bytes, not fp32


def test_auto_keeps_each_parameters_dtype() -> None:
    state = {"w": torch.randn(4, 3, dtype=torch.float64)}
    share = ShareStaging(0, 1, export_dtype("auto")).export(shards_of(state, 0, 1))
    assert share.tensors["w"][0] == "F64" and torch.equal(share.pieces[0].data, state["w"])
    with pytest.raises(ValueError, match="use auto or one of"):
        export_dtype("fp8")


def test_a_buffer_is_reused_only_once_no_share_points_into_it() -> None:
    parameters = {"w": torch.zeros(16, 8)}
    staging = ShareStaging(0, 1, torch.bfloat16)

    def export(value: float):
        parameters["w"].fill_(value)
        return staging.export(shards_of(parameters, 0, 1))

    kept = export(1.0)
    pushing = export(2.0)  # the kept share is alive: another buffer
    assert staging.buffers == 2 and torch.all(kept.pieces[0].data == 1) and torch.all(pushing.pieces[0].data == 2)
    del kept  # persisted: let go
    following = export(3.0)
    assert staging.buffers == 2 and torch.all(pushing.pieces[0].data == 2) and torch.all(following.pieces[0].data == 3)
    cycle = [pushing]
    cycle.append(cycle)  # let go inside a reference cycle (as a retried push's traceback holds it)
    del pushing, cycle
    export(4.0)
    assert staging.buffers == 2


@pytest.fixture
def one_rank_group():
    from support import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_dim0_shards_of_a_fully_sharded_model_export_to_its_full_tensors(one_rank_group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 3))
    fully_shard(model)
    state = model.state_dict()
    share = ShareStaging(0, 1, torch.bfloat16).export(local_shards(state, 0))
    for piece in share.pieces:
        full = state[piece.name].full_tensor().to(torch.bfloat16)
        assert piece.start == 0 and torch.equal(piece.data, full)
    assert {n: s for n, (_, s) in share.tensors.items()} == {n: tuple(t.shape) for n, t in state.items()}
    assert math.prod(share.tensors["0.weight"][1]) * 2 == share.pieces[0].data.nbytes


def test_a_job_exports_the_dtype_its_instances_run() -> None:
    from staleflow.config import JobConfig

    assert JobConfig().trainer.export_dtype == "float32"  # the CPU demo's engine runs fp32
    assert JobConfig(vllm_args={"max_model_len": 64}).trainer.export_dtype == "bfloat16"  # the engine's default
    assert JobConfig(vllm_args={"dtype": "half"}).trainer.export_dtype == "float16"
    assert JobConfig(vllm_args={"dtype": "auto"}).trainer.export_dtype == "auto"  # the model's own: kept
    assert JobConfig(trainer={"export_dtype": "bfloat16"}).trainer.export_dtype == "bfloat16"
