"""Tensor-parallel slice pulls for vLLM workers: which part of each checkpoint tensor a worker's
parameters take, read from vLLM's own sharding metadata, and loading those parts pre-sliced.

Checked against vLLM 0.32.0's ``linear.py`` and ``parameter.py``. A worker of a ``tp``-way engine
keeps ``1/tp`` of each column-parallel parameter (``output_dim``), row-parallel parameter
(``input_dim``) and of each part of a stacked one (``qkv_proj`` from ``q/k/v_proj``,
``gate_up_proj`` from ``gate/up_proj``, per the model's ``packed_modules_mapping``); ``k_proj``
and ``v_proj`` are cut into ``tp // num_kv_head_replicas`` parts when KV heads are replicated.
Everything else (embeddings, whose vocabulary is padded before it is split, ``lm_head``, norms,
replicated and quantized layers, checkpoints with fused ``qkv_proj``) is pulled whole and
narrowed by vLLM as usual.

vLLM's loaders narrow every tensor they get at ``tp_rank * shard_size``. A pre-sliced tensor
must not be narrowed again, and 0.32.0 has two loader families:

* plain ``Parameter`` s (the biases) use the layer's ``weight_loader``, which skips the narrow
  when the parameter has ``is_sharded_weight`` set;
* ``BasevLLMParameter`` s (every unquantized weight: ``ModelWeightParameter``) use
  ``weight_loader_v2``, which ignores ``is_sharded_weight`` and narrows at the parameter's own
  ``tp_rank``; a pre-sliced tensor has exactly the shard's size, so with ``tp_rank = 0`` the
  narrow is the identity (vLLM does the same for its replicated MLA latents).

vLLM's in-place reload loads into parameters materialized from metadata it recorded when the
model was first loaded (``LAYERWISE_INFO``), not into the live ones, so the marks go on both
and are taken off again after the pull.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from staleflow.transports.selection import TensorSlice


@dataclass(frozen=True)
class TpSlicePlan:
    select: dict[str, TensorSlice | None]  # checkpoint tensor name -> the part this worker pulls
    presliced: frozenset[str]  # the model's parameters that receive only pre-sliced tensors

    @property
    def sliced(self) -> bool:
        return bool(self.presliced)


@dataclass(frozen=True)
class _Target:
    parameter: str  # the model's parameter name
    part: TensorSlice | None


def plan_tp_slices(model: Any, shapes: Mapping[str, Sequence[int]]) -> TpSlicePlan:
    """Each checkpoint tensor's part for this worker (``shapes``: name -> full shape), from the
    sharding metadata of the vLLM parameter it loads into. A parameter is pre-sliced only when
    every tensor loading into it is sliced; else all of them are pulled whole."""
    targets = {name: _target(model, name, tuple(shape)) for name, shape in shapes.items()}
    whole_params = {t.parameter for t in targets.values() if t.parameter and t.part is None}
    select: dict[str, TensorSlice | None] = {}
    presliced: set[str] = set()
    for name, target in targets.items():
        if target.part is not None and target.parameter not in whole_params:
            select[name] = target.part
            presliced.add(target.parameter)
        else:
            select[name] = None
    return TpSlicePlan(select, frozenset(presliced))


def _stacked(model: Any, module_path: str) -> tuple[str, int] | None:
    """(stacked module path, position) when ``module_path`` is one part of a stacked module."""
    parent, _, leaf = module_path.rpartition(".")
    for stacked, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts:
            return (f"{parent}.{stacked}" if parent else stacked), list(parts).index(leaf)
    return None


def reload_layer_of(model: Any, name: str) -> str:
    """The module of ``model`` that checkpoint tensor ``name`` loads into: the stacked module for
    a part of one (``q_proj`` -> ``qkv_proj``), else the nearest module on its path (a fused MoE
    layer for one expert's tensor); "" when none is."""
    module_path = name.rpartition(".")[0]
    stacked = _stacked(model, module_path)
    if stacked is not None:
        module_path = stacked[0]
    while module_path:
        try:
            model.get_submodule(module_path)
        except AttributeError:
            module_path = module_path.rpartition(".")[0]
        else:
            return module_path
    return ""


def _target(model: Any, name: str, shape: tuple[int, ...]) -> _Target:
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )

    module_path, _, param_name = name.rpartition(".")
    stacked = _stacked(model, module_path)
    if stacked is not None:
        module_path = stacked[0]
    try:
        layer = model.get_submodule(module_path)
    except AttributeError:
        return _Target("", None)
    # what the reload loads into: the parameter as recorded at the first load (vLLM-CPU replaces
    # a loaded weight by a packed one without the sharding attributes), else the live one
    param = _recorded(layer, param_name)
    if param is None:
        param = layer._parameters.get(param_name)
    parameter = f"{module_path}.{param_name}"
    if (param is None or getattr(layer, "tp_size", 1) <= 1
            or not isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)):
        return _Target(parameter if param is not None else "", None)
    rank, size = layer.tp_rank, layer.tp_size
    output_dim, input_dim = getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    part: TensorSlice | None = None
    if isinstance(layer, QKVParallelLinear):
        if stacked is not None and output_dim is not None and len(layer.output_sizes) == 3:
            replicas = layer.num_kv_head_replicas
            part = (TensorSlice(output_dim, rank, size) if stacked[1] == 0
                    else TensorSlice(output_dim, rank // replicas, size // replicas))
    elif isinstance(layer, MergedColumnParallelLinear):
        if stacked is not None and output_dim is not None and stacked[1] < len(layer.output_sizes):
            part = TensorSlice(output_dim, rank, size)
    elif isinstance(layer, ColumnParallelLinear):
        if stacked is None and output_dim is not None:
            part = TensorSlice(output_dim, rank, size)
    elif isinstance(layer, RowParallelLinear):
        if stacked is None and input_dim is not None:
            part = TensorSlice(input_dim, rank, size)
    if part is not None and (part.dim >= len(shape) or shape[part.dim] % part.count):
        part = None  # vLLM's layers only split evenly; let its loader say what is wrong
    return _Target(parameter, part)


def _recorded(layer: Any, param_name: str) -> Any:
    """The parameter vLLM's in-place reload rebuilds ``param_name`` from, if it recorded one."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return None if info is None else info.restore_metadata[0].get(param_name)


def _parameters_and_their_reload_metadata(model: Any, parameter: str) -> list[Any]:
    module_path, _, param_name = parameter.rpartition(".")
    layer = model.get_submodule(module_path)
    return [p for p in (layer._parameters.get(param_name), _recorded(layer, param_name)) if p is not None]


@contextmanager
def presliced_loading(model: Any, presliced: frozenset[str] | set[str]) -> Iterator[None]:
    """While open, vLLM's loaders take the ``presliced`` parameters' tensors as already cut to
    this worker's shard (see the module docstring); the parameters are as before afterwards."""
    from vllm.model_executor.parameter import BasevLLMParameter

    missing = object()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for parameter in sorted(presliced):
            for param in _parameters_and_their_reload_metadata(model, parameter):
                attr, value = (("tp_rank", 0) if isinstance(param, BasevLLMParameter)
                               else ("is_sharded_weight", True))
                saved.append((param, attr, vars(param).get(attr, missing)))
                vars(param)[attr] = value
        yield
    finally:
        for param, attr, value in reversed(saved):
            if value is missing:
                vars(param).pop(attr, None)
            else:
                vars(param)[attr] = value
