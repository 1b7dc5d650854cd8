"""Tensor tables of real architectures, and how FSDP2 splits them across ranks.

``model_tensor_table`` builds a model from its ``config.json`` on PyTorch's meta device (no
memory, no weights) and reads the names, shapes and dtypes of what a trainer pushes: the state
dict in module order, tied weights once (the tied head is dropped, as the FSDP trainer does).
transformers 5 holds a MoE layer's experts fused (``experts.gate_up_proj`` of shape
``[experts, 2 * intermediate, hidden]``); checkpoints and engines (vLLM's ``load_weights``) name
them per expert, so by default the table splits them back into ``experts.{e}.gate_proj.weight``,
``up_proj`` and ``down_proj`` -- thousands of small tensors for a model with many experts.

``fsdp_shard_ranges`` is FSDP2's dim-0 split (``torch.chunk``: ``ceil(rows / ranks)`` rows per
rank, the last ranks possibly fewer or none); a 0-dimensional tensor stays whole on rank 0.

No I/O beyond reading the config file; torch and transformers are imported on use.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

from staleflow.transports.dtypes import DTYPE_SIZES
from staleflow.transports.errors import FormatError

TensorTable = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)

_DTYPE_NAMES = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "half": "F16",
                "fp32": "F32", "float32": "F32", "float": "F32"}
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>[A-Za-z0-9_]+)$")


def table_dtype(name: str) -> str:
    """The safetensors dtype for ``bf16``/``fp16``/``fp32`` (or their torch spellings)."""
    dtype = _DTYPE_NAMES.get(name.strip().lower().removeprefix("torch."))
    if dtype is None:
        raise FormatError(f"dtype {name!r}: use bf16, fp16 or fp32")
    return dtype


def load_config(source: str | Path) -> Mapping:
    """A model's config as a dict: ``source`` is a ``config.json`` or a directory holding one."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file; give a model directory or its config.json") from None
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise FormatError(f"{path}: a transformers config.json needs a 'model_type'")
    return config


def model_tensor_table(source: str | Path | Mapping, dtype: str | None = None, per_expert: bool = True) -> TensorTable:
    """The tensor table of the model ``source`` describes (a config.json, a directory with one,
    or the config as a dict), in the state dict's order. ``dtype``: every floating tensor's dtype
    (default: the config's ``torch_dtype``/``dtype``, else bf16). ``per_expert``: fused MoE expert
    tensors split per expert, as checkpoints and engines name them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(source) if isinstance(source, Mapping) else dict(load_config(source))
    wanted = table_dtype(dtype or str(config.get("torch_dtype") or config.get("dtype") or "bf16"))
    model_type = config.pop("model_type")
    try:
        built = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "architectures"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built)
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"cannot build model_type {model_type!r} from its config: {exc}") from None
    table: TensorTable = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight: pushed once, under its first name
            continue
        seen.add(id(tensor))
        st_dtype = wanted if tensor.is_floating_point() else _torch_dtype_name(tensor.dtype)
        shape = tuple(int(d) for d in tensor.shape)
        fused = _FUSED_EXPERTS.match(name) if per_expert and len(shape) == 3 else None
        if fused is None:
            table[name] = (st_dtype, shape)
        else:
            table.update(_per_expert(fused["prefix"], fused["kind"], st_dtype, shape))
    return table


def _per_expert(prefix: str, kind: str, dtype: str, shape: tuple[int, ...]) -> TensorTable:
    experts, rows, cols = shape
    if kind == "gate_up_proj":  # [gate; up] along the rows, per expert
        return {f"{prefix}.{e}.{proj}.weight": (dtype, (rows // 2, cols)) for e in range(experts) for proj in ("gate_proj", "up_proj")}
    return {f"{prefix}.{e}.{kind}.weight": (dtype, (rows, cols)) for e in range(experts)}


def _torch_dtype_name(dtype: object) -> str:
    names = {"float64": "F64", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
    name = str(dtype).removeprefix("torch.")
    if name not in names:
        raise FormatError(f"tensor dtype {dtype} has no safetensors equivalent")
    return names[name]


def table_bytes(table: Mapping[str, tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * DTYPE_SIZES[dtype] for dtype, shape in table.values())


def fsdp_shard_ranges(table: Mapping[str, tuple[str, tuple[int, ...]]], rank: int, ranks: int) -> list[tuple[str, int, int]]:
    """(name, first byte, bytes) of rank ``rank``'s dim-0 shard of every tensor, as FSDP2 splits
    them across ``ranks`` (``torch.chunk`` along dim 0); 0-d tensors whole on rank 0. Empty shards
    are left out."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not in [0, {ranks})")
    ranges = []
    for name, (dtype, shape) in table.items():
        if not shape:
            if rank == 0:
                ranges.append((name, 0, DTYPE_SIZES[dtype]))
            continue
        row_bytes = math.prod(shape[1:]) * DTYPE_SIZES[dtype]
        rows = -(-shape[0] // ranks)
        local_rows = max(0, min(shape[0], (rank + 1) * rows) - rank * rows)
        if local_rows and row_bytes:
            ranges.append((name, rank * rows * row_bytes, local_rows * row_bytes))
    return ranges
