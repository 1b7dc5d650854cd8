"""The vLLM worker's pull windows: every tensor once, in data-section order, windows within the
limit (a bigger tensor alone), and, given the engine layer each tensor loads into, no layer that
fits in a window split across two (vLLM holds a split layer's tensors, and so the earlier
window's buffer, until the rest arrive)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from staleflow.engines.vllm_worker import pull_windows
from staleflow.transports.layout import TensorSpec

layers = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), min_size=1, max_size=60)  # (layer, bytes)


def table(entries: list[tuple[int, int]]) -> tuple[list[TensorSpec], dict[str, str]]:
    specs, layer_of, offset = [], {}, 0
    for i, (layer, nbytes) in enumerate(entries):
        name = f"t{i}"
        specs.append(TensorSpec(name, "U8", (nbytes,), offset, nbytes))
        layer_of[name] = f"layer{layer}"
        offset += nbytes
    return specs, layer_of


@given(entries=layers, limit=st.integers(1, 100), by_layer=st.booleans())
def test_windows_keep_order_and_limit_and_each_layer_that_fits_whole(entries: list[tuple[int, int]], limit: int,
                                                                      by_layer: bool) -> None:
    specs, layer_of = table(entries)
    size = {spec.name: spec.nbytes for spec in specs}
    windows = pull_windows(specs, limit, layer_of=layer_of.get if by_layer else None)
    assert [name for window in windows for name in window] == [spec.name for spec in specs]
    assert all(window for window in windows)
    assert all(len(window) == 1 or sum(size[n] for n in window) <= limit for window in windows)
    if not by_layer:
        return
    window_of = {name: i for i, window in enumerate(windows) for name in window}
    run: list[str] = []
    for spec in [*specs, None]:  # each maximal run of one layer's tensors
        if run and (spec is None or layer_of[spec.name] != layer_of[run[0]]):
            if sum(size[n] for n in run) <= limit:
                assert len({window_of[n] for n in run}) == 1, (run, windows)
            run = []
        if spec is not None:
            run.append(spec.name)


def test_a_layer_cut_by_the_limit_moves_whole_into_the_next_window() -> None:
    specs, layer_of = table([(0, 6), (1, 3), (1, 3)])
    assert pull_windows(specs, 10) == [["t0", "t1"], ["t2"]]
    assert pull_windows(specs, 10, layer_of=layer_of.get) == [["t0"], ["t1", "t2"]]


def test_each_checkpoint_tensor_belongs_to_the_module_it_loads_into() -> None:
    import pytest

    torch = pytest.importorskip("torch")
    from staleflow.engines.vllm_tp import reload_layer_of

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.qkv_proj = torch.nn.Linear(2, 6)
            self.mlp = torch.nn.Module()
            self.mlp.experts = torch.nn.Linear(2, 2)  # a fused MoE layer: no module per expert

    class Model(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer()])
            self.model.norm = torch.nn.LayerNorm(2)

    model = Model()
    assert reload_layer_of(model, "model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj"
    assert reload_layer_of(model, "model.layers.0.mlp.experts.3.gate_proj.weight") == "model.layers.0.mlp.experts"
    assert reload_layer_of(model, "model.norm.weight") == "model.norm"
    assert reload_layer_of(model, "lm_head.weight") == ""
