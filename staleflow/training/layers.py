"""What the trainer does to each decoder layer before sharding it: Liger's fused kernels,
activation checkpointing (full or selective) and ``torch.compile``.

- **Liger** (``fused_kernels``): ``apply_liger_kernel_to_<model_type>(rope, rms_norm, swiglu,
  model=...)`` binds Triton RMSNorm and SwiGLU forwards onto the model's own modules and swaps
  the RoPE function; parameter names, hence checkpoints and FSDP2's sharding, stay the same.
  CUDA only (Triton has no CPU driver); its cross-entropy patches stay off, the trainer has its
  own log-prob head.
- **Selective checkpointing** keeps each layer's matmul and attention outputs and recomputes
  only the pointwise ops (norms, SiLU, RoPE, residual adds) in backward: no matmul runs twice,
  and a layer keeps about half of what it keeps without checkpointing. Full checkpointing keeps
  only the layer's input and reruns its whole forward.
- **Compile**: each layer's forward is compiled with ``dynamic=True`` (one graph for every length
  and every layer), with the checkpointing inside the compiled region and FSDP2's hooks outside.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from staleflow.training.attention import torch_varlen_attn
from staleflow.training.logprobs import liger_available
from staleflow.training.memory_model import CheckpointingPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def liger_layers_available(device: torch.device) -> bool:
    return liger_available(device, "liger_kernel.transformers")


def liger_patch_for(model_type: str) -> Callable[..., Any] | None:
    """``apply_liger_kernel_to_<model_type>``, or None where Liger has none for the type."""
    import liger_kernel.transformers as liger  # pyright: ignore[reportMissingImports]  (the liger extra)

    return getattr(liger, f"apply_liger_kernel_to_{model_type}", None)


def apply_liger_layers(model: torch.nn.Module) -> None:
    """Liger's RMSNorm, RoPE and SwiGLU on this model's modules (before ``fully_shard``)."""
    model_type = getattr(model.config, "model_type", "?")
    patch = liger_patch_for(model_type)
    if patch is None:
        raise ValueError(f"trainer.fused_kernels: liger_kernel has no kernels for model_type {model_type!r}; set "
                         "fused_kernels to auto or false")
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
              "fused_linear_cross_entropy": False, "model": model}
    accepted = inspect.signature(patch).parameters
    patch(**{k: v for k, v in wanted.items() if k in accepted})


def fused_kernels_for(setting: bool | str, device: torch.device, model_type: str | None, compiled: bool) -> bool:
    """Whether Liger's layer kernels are applied. auto: with CUDA and liger_kernel importable
    and kernels for the model type, unless the layers are compiled (inductor fuses the same
    pointwise ops); true: refused where they cannot run."""
    if setting is False:
        return False
    available = liger_layers_available(device)
    if setting == "auto":
        return available and not compiled and model_type is not None and liger_patch_for(model_type) is not None
    if not available:
        raise ValueError("trainer.fused_kernels: true needs CUDA and liger_kernel (pip install 'staleflow[liger]'); "
                         "set it to auto or false")
    return True


def checkpointing_for(setting: bool | str, device: torch.device) -> CheckpointingPolicy:
    """auto: selective with CUDA, none on the CPU (fp32, memory is not the limit there)."""
    if setting == "auto":
        return "selective" if device.type == "cuda" else "none"
    if setting == "selective":
        return "selective"
    return "full" if setting else "none"


@functools.cache
def saved_ops() -> frozenset[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    if torch_varlen_attn() is not None:  # importing it registers its op
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    return frozenset(ops)


def _keep_matmuls_and_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Callable[[], Any]:
    """The ``context_fn`` of a selective ``torch.utils.checkpoint.checkpoint``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)


def checkpoint_kwargs(policy: CheckpointingPolicy) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = selective_context()
    return kwargs


def prepare_layers(model: PreTrainedModel, layers: list[torch.nn.Module], policy: CheckpointingPolicy,
                   compiled: bool) -> None:
    """Checkpointing and compile for a trainable model's decoder layers, before ``fully_shard``.
    Eager: transformers' own gradient checkpointing with the policy's kwargs. Compiled: each
    layer's forward becomes a compiled function that checkpoints the original forward inside."""
    if not compiled:
        if policy != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(policy))
        return
    if os.environ.get("TORCHDYNAMO_DISABLE") == "1" or os.environ.get("TORCH_COMPILE_DISABLE") == "1":
        # torch would run the "compiled" layers eagerly without a word
        raise ValueError("compile: true, but torch.compile is disabled in this process (TORCHDYNAMO_DISABLE or "
                         "TORCH_COMPILE_DISABLE is 1; the vLLM CPU engine sets the first for enforce_eager "
                         "instances in its process): run the trainer in a process of its own, or set compile: false")
    for layer in layers:
        layer.forward = compiled_forward(layer.forward, policy)


def compiled_forward(forward: Callable[..., Any], policy: CheckpointingPolicy) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    if policy == "none":
        return torch.compile(forward, dynamic=True)
    kwargs = checkpoint_kwargs(policy)

    def checkpointed(*args: Any, **inputs: Any) -> Any:
        return checkpoint(forward, *args, **kwargs, **inputs)

    return torch.compile(checkpointed, dynamic=True)
