"""Packed micro-batches: one row of concatenated sequences whose attention stays within each.

The trainer registers its own transformers attention implementation (``PACKED_ATTENTION``).
transformers 5 builds no attention mask for a registered name and hands the packed row's
boundaries (``cu_seq_lens_q/k``, int32, and ``max_length_q/k``, Python ints) from
``model(**inputs)`` through to it. On CUDA it calls torch's own varlen flash attention
(``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10: no flash-attn package needed); on CPU
it runs the same computation as causal SDPA per sequence, exact, so the CPU tests train through
the same registered path. A model configured for flash attention keeps it: transformers' flash
path takes the same inputs.

``varlen_attn``'s keywords differ by torch version; ``varlen_causal`` inspects its signature:

- 2.10: ``is_causal=True``; grouped-query K/V are repeated to the query heads (no GQA promise);
- 2.11: ``window_size=(-1, 0)``; no ``enable_gqa``: K/V with fewer heads go to FA2 as they are;
- 2.12 and later: ``window_size=(-1, 0)`` and ``enable_gqa=True``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_ATTENTION = "staleflow_varlen"
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def torch_varlen_attn() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                  cu_seq_k: torch.Tensor, max_q: int, max_k: int, scale: float | None,
                  varlen: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Causal varlen attention over [tokens, heads, dim] inputs, whatever ``varlen_attn``'s
    version (``varlen``: the function to call, torch's by default)."""
    varlen = varlen or torch_varlen_attn()
    if varlen is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is missing (torch >= 2.10 has it)")
    accepted = inspect.signature(varlen).parameters
    kwargs: dict[str, Any] = {}
    if "scale" in accepted:
        kwargs["scale"] = scale
    elif scale is not None:  # 2.10 scales by 1/sqrt(dim) itself: fold the difference into the queries
        query = query * (scale * query.shape[-1] ** 0.5)
    if "window_size" in accepted:
        kwargs["window_size"] = (-1, 0)  # no limit to the left, none to the right: causal
        if "enable_gqa" in accepted:
            kwargs["enable_gqa"] = True
    elif "is_causal" in accepted:
        kwargs["is_causal"] = True
        groups = query.shape[-2] // key.shape[-2]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=-2), value.repeat_interleave(groups, dim=-2)
    else:
        raise RuntimeError(f"varlen_attn{inspect.signature(varlen)} takes neither window_size nor is_causal")
    return varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)


def per_sequence_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """The same as ``varlen_causal`` for [1, heads, tokens, dim] inputs, one causal SDPA per
    sequence; returns [1, tokens, heads, dim]. For the CPU, where reading the boundaries is free."""
    bounds = cu_seq.tolist()
    outputs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, scale=scale,
        enable_gqa=True) for start, end in zip(bounds[:-1], bounds[1:], strict=False) if end > start]
    return torch.cat(outputs, dim=2).transpose(1, 2)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention: query [B, Hq, T, D], key/value [B, Hkv, T, D]; returns
    [B, T, Hq, D]. Without the packed boundaries (a padded batch) each row is one causal
    sequence: right padding needs no mask, a real token never attends to the pads after it."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{type(module).__name__} uses sliding-window attention, which packed attention does not "
                         "apply; set trainer.packing to false")
    if dropout:
        raise ValueError("packed attention has no dropout; set the model's attention_dropout to 0")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):  # flash kernels: half precision
        return per_sequence_sdpa(query, key, value, cu_q, scaling), None
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = varlen_causal(q, k, v, cu_q, cu_k if cu_k is not None else cu_q, kwargs["max_length_q"],
                        kwargs.get("max_length_k", kwargs["max_length_q"]), scaling)
    return out[None], None


def register_packed_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def packed_inputs(lengths: list[int]) -> dict[str, Any]:
    """The packed row's boundaries for ``model(**inputs)``: cumulative lengths (int32) and the
    longest sequence, the same for queries and keys."""
    cumulative = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative, "max_length_q": longest, "max_length_k": longest}


def packing_for(model: PreTrainedModel, setting: bool | str, device: torch.device) -> bool:
    """Whether micro-batches are packed, switching the model's attention to the packed one where
    needed (before sharding). auto: with flash attention configured, or with CUDA and torch's
    varlen attention; true: anywhere (the CPU runs the exact per-sequence fallback), refused for
    a model whose attention does not go through transformers' attention functions."""
    current = getattr(model.config, "_attn_implementation", None)
    if current in FLASH_ATTENTION:
        return setting is not False
    if setting == "auto":
        setting = device.type == "cuda" and torch_varlen_attn() is not None
    if not setting:
        return False
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"trainer.packing: true, but {type(model).__name__}'s attention cannot take packed rows (it "
                         "does not use transformers' attention functions); set packing to auto or false")
    if device.type == "cuda" and torch_varlen_attn() is None:
        raise ValueError(f"trainer.packing: true on CUDA needs torch's varlen attention (torch >= 2.10, this is "
                         f"{torch.__version__}) or a model configured for flash attention; set packing to auto or false")
    register_packed_attention()
    model.set_attn_implementation(PACKED_ATTENTION)
    return True
