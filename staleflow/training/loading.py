"""Build a Hugging Face causal LM on the meta device and load only this rank's shards into it.

Every rank builds the model's structure with no storage (parameters on ``meta``), shards it with
``fully_shard``, allocates only its own shards (``to_empty``) and reads, for each parameter, only
its rows of the safetensors file (``safe_open(...).get_slice``). No rank ever holds more than its
shards plus one tensor being read, so a model larger than one GPU starts on many.

Buffers (rotary frequencies) are small and computed at construction: they are built for real on
the host and put back on the device after ``to_empty``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelLoadError(ValueError):
    """A model directory this trainer cannot load, with the reason and what to do."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (no storage); their
    buffers stay real, on the host."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_causal_lm(model_dir: Path) -> PreTrainedModel:
    """The model's structure from its ``config.json``: fp32 parameters on meta, real buffers."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{model_dir}: no Hugging Face config.json this transformers "
                             f"({transformers.__version__}) can read: {e}") from e
    try:
        with parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: model_type {getattr(config, 'model_type', '?')!r} "
                             f"(architectures {getattr(config, 'architectures', None)}) is not a causal LM this "
                             f"transformers ({transformers.__version__}) can build; use a decoder-only model") from e
    return model.float()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, each its own FSDP2 unit: the longest ``ModuleList`` of the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ModelLoadError(f"{type(model).__name__}: no list of decoder layers to shard")
    return list(max(lists, key=len))


def materialize(model: torch.nn.Module, device: torch.device, params_device: torch.device | None = None) -> None:
    """Give the (sharded) meta parameters storage on ``params_device`` (default ``device``; the
    host with optimizer offload) and the buffers their constructed values on ``device``."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device=params_device or device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        persistent = leaf not in module._non_persistent_buffers_set
        module.register_buffer(leaf, value.to(device), persistent=persistent)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights (the sharded load reads safetensors; "
                             "re-save the model with save_pretrained(safe_serialization=True))")
    return files


def local_rows(param: Any) -> tuple[torch.Tensor, int, int]:
    """(this rank's local storage of ``param``, first row, row count) for a dim-0 sharded DTensor;
    a plain tensor is all its rows."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.data, 0, param.shape[0] if param.dim() else 0
    placements = tuple(param.placements)
    if any(isinstance(p, Shard) and p.dim != 0 for p in placements):
        raise ModelLoadError(f"placements {placements} are not dim-0 shards")
    local_shape, offset = compute_local_shape_and_global_offset(tuple(param.shape), param.device_mesh, placements)
    local = param.to_local()
    rows = local_shape[0] if local_shape else 0
    return local, (offset[0] if offset else 0), rows


def load_sharded(model: torch.nn.Module, model_dir: Path) -> int:
    """Copy this rank's rows of every parameter (and persistent buffer) from ``model_dir``'s
    safetensors into the materialised model; returns the bytes read. A tied output head is
    the embedding; any other parameter missing from the files is an error."""
    from safetensors import safe_open

    wanted: dict[str, torch.Tensor] = dict(model.named_parameters())
    persistent = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    wanted.update(persistent)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(dict(model.named_parameters()))
    found: set[str] = set()
    read = 0
    with torch.no_grad():
        for path in _safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = wanted.get(name)
                    if target is None:
                        continue
                    local, first, rows = local_rows(target)
                    if target.dim() == 0:
                        local.copy_(f.get_tensor(name))
                    elif rows:
                        part = f.get_slice(name)[first:first + rows]
                        local[:rows].copy_(part)
                        read += part.numel() * part.element_size()
                    found.add(name)
    missing = set(dict(model.named_parameters())) - found - tied
    if missing:
        raise ModelLoadError(f"{model_dir}: the weights lack {len(missing)} parameters of the model, e.g. "
                             f"{sorted(missing)[:3]}; is it the checkpoint of this config.json?")
    return read
