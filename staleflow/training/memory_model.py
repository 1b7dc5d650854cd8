"""How many tokens one micro-batch can hold on a GPU: the memory model behind
``max_tokens_per_micro_batch: auto``.

A rank's peak during a micro-batch is a fixed part plus a part per token:

* fixed: the sharded training state (fp32 parameters, gradients and AdamW's two moments: 16 bytes
  per parameter over the ranks; none of it with optimizer offload), a frozen reference's fp32
  shards when ``kl_coef > 0``, the root's gathered bf16 embedding and head, the head's fp32
  gradient accumulator [V, H] and one chunk of its logits (fp32, and its bf16 copy in backward),
  two decoder layers gathered at once (the prefetch) with their gradients, and some allocator slack;
* per token: what each decoder layer keeps for backward under the checkpointing policy, for every
  layer, plus one layer's full activations while it is recomputed and differentiated, plus the
  residual stream's gradients at the ends of the stack.

What a layer keeps per token (bf16, measured on CPU for one Qwen2.5-1.5B-shaped layer: 101 KiB
without checkpointing, 48 + 3 KiB with selective checkpointing, 3 KiB with full), from the shape:

* ``full``: the layer's input, ``2H`` bytes;
* ``selective`` (save the matmul and attention outputs, recompute the pointwise ops): the input
  plus the q/k/v, attention, o, gate, up and down outputs, ``2 (5H + 2 kv + 2I)`` bytes;
* ``none``: the matmul and attention outputs, SiLU's and SiLU x up's outputs (``2 x 2I``) and the
  two RMSNorms' fp32 input and bf16 output (``2 x 6H``): ``2 (4H + 2 kv + 2I) + 4I + 12H`` bytes.

Those are estimates from the shape, made without a GPU; a GPU run checks the resulting peak
(docs/training.md lists what it must show).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from staleflow.config import TrainerConfig

log = logging.getLogger(__name__)

CheckpointingPolicy = Literal["none", "selective", "full"]
CHECKPOINTING_POLICIES: tuple[CheckpointingPolicy, ...] = ("none", "selective", "full")

STATE_BYTES_PER_PARAMETER = 16
"""fp32 parameter, fp32 gradient and AdamW's two fp32 moments, sharded over the ranks."""
REFERENCE_BYTES_PER_PARAMETER = 4
ALLOCATOR_SLACK_BYTES = 1 << 29
"""Fragmentation across micro-batches of different lengths: half a GiB."""
DEVICE_MEMORY_USABLE = 0.95
"""Of a GPU's total memory, what the plan may use (the CUDA context and libraries take the rest)."""
MIN_AUTO_TOKENS = 1024
BUDGET_GRANULE = 128


@dataclass(frozen=True)
class DecoderShape:
    """What the memory model needs of a decoder LM."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv_width: int
    """key (or value) width per token: KV heads x head size."""
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config: Any, parameters: int) -> DecoderShape:
        """From a Hugging Face config (Llama/Qwen2-style names) and the parameter count."""
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        return cls(parameters=parameters, layers=int(config.num_hidden_layers), hidden=hidden,
                   intermediate=intermediate, kv_width=kv_heads * head_dim, vocab=int(config.vocab_size),
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def layer_parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return max(0, self.parameters - embeddings) // max(self.layers, 1)


def saved_bytes_per_token_per_layer(shape: DecoderShape, policy: CheckpointingPolicy, element_bytes: int = 2) -> int:
    """What one decoder layer keeps for its backward, per token, under ``policy``."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_width
    scale = element_bytes / 2
    if policy == "full":
        return round(2 * h * scale)
    if policy == "selective":
        return round(2 * (5 * h + 2 * kv + 2 * i) * scale)
    if policy == "none":
        return round((2 * (4 * h + 2 * kv + 2 * i) + 4 * i + 12 * h) * scale)
    raise ValueError(f"unknown checkpointing policy {policy!r}: one of {', '.join(CHECKPOINTING_POLICIES)}")


def bytes_per_token(shape: DecoderShape, policy: CheckpointingPolicy, element_bytes: int = 2) -> int:
    """A micro-batch's memory per token: every layer's saved activations, one layer recomputed and
    differentiated at a time (none when nothing is recomputed: its activations are counted), and
    the residual stream's gradients at the ends of the stack (four of ``H``)."""
    saved = shape.layers * saved_bytes_per_token_per_layer(shape, policy, element_bytes)
    recomputed = 0 if policy == "none" else saved_bytes_per_token_per_layer(shape, "none", element_bytes)
    return saved + recomputed + 4 * shape.hidden * element_bytes


def fixed_bytes(shape: DecoderShape, world: int, chunk_logit_bytes: int, element_bytes: int = 2,
                offload: bool = False, reference: bool = False) -> int:
    """A rank's memory that does not grow with the micro-batch (see the module's docstring)."""
    state = 0 if offload else STATE_BYTES_PER_PARAMETER * shape.parameters // world
    if reference and not offload:
        state += REFERENCE_BYTES_PER_PARAMETER * shape.parameters // world
    head = shape.vocab * shape.hidden
    gathered_root = head * element_bytes * (1 if shape.tied else 2)
    head_work = head * 4 + chunk_logit_bytes * 3 // 2  # fp32 gradient accumulator; fp32 logits + bf16 copy
    prefetched_layers = 2 * 2 * shape.layer_parameters * element_bytes  # two layers, parameters and gradients
    return state + gathered_root + head_work + prefetched_layers + ALLOCATOR_SLACK_BYTES


def token_budget(shape: DecoderShape, policy: CheckpointingPolicy, memory_bytes: int, world: int = 1,
                 chunk_logit_bytes: int = 1 << 30, element_bytes: int = 2, offload: bool = False,
                 reference: bool = False) -> int:
    """Tokens per micro-batch whose planned peak fits ``memory_bytes`` (a multiple of
    ``BUDGET_GRANULE``); 0 when even the fixed part does not fit."""
    room = memory_bytes - fixed_bytes(shape, world, chunk_logit_bytes, element_bytes, offload, reference)
    tokens = max(0, room) // bytes_per_token(shape, policy, element_bytes)
    return tokens // BUDGET_GRANULE * BUDGET_GRANULE


def auto_token_budget(shape: DecoderShape, policy: CheckpointingPolicy, device_memory: int, planned_memory: int,
                      world: int, chunk_logit_bytes: int, element_bytes: int = 2, offload: bool = False,
                      reference: bool = False) -> int:
    """The budget ``max_tokens_per_micro_batch: auto`` resolves to on a GPU with ``device_memory``
    bytes, planning for ``planned_memory`` (at most the usable part of the device). When the
    model leaves less than ``MIN_AUTO_TOKENS`` within the plan, the plan grows to the whole usable
    device; when not even that holds them, ``MIN_AUTO_TOKENS`` (with a warning)."""
    usable = int(device_memory * DEVICE_MEMORY_USABLE)
    def budget_within(memory: int) -> int:
        return token_budget(shape, policy, memory, world=world, chunk_logit_bytes=chunk_logit_bytes,
                            element_bytes=element_bytes, offload=offload, reference=reference)

    budget = budget_within(min(planned_memory, usable))
    if budget < MIN_AUTO_TOKENS:
        budget = budget_within(usable)
    if budget < MIN_AUTO_TOKENS:
        log.warning("the memory model leaves room for %d tokens per micro-batch on this GPU (%.1f GiB); using %d: "
                    "the step may run out of memory (more ranks, optimizer_offload or activation checkpointing "
                    "help)", budget, device_memory / 2**30, MIN_AUTO_TOKENS)
        budget = MIN_AUTO_TOKENS
    return budget


def policy_of(activation_checkpointing: bool | str) -> CheckpointingPolicy:
    """A resolved ``activation_checkpointing`` setting as a policy name: true is full
    checkpointing, false none; a policy name stays."""
    if activation_checkpointing is True:
        return "full"
    if activation_checkpointing is False:
        return "none"
    if activation_checkpointing not in CHECKPOINTING_POLICIES:
        raise ValueError(f"unknown checkpointing policy {activation_checkpointing!r}")
    return activation_checkpointing  # type: ignore[return-value]


def resolve_token_budget(cfg: TrainerConfig, device: Any, shape: DecoderShape, policy: CheckpointingPolicy,
                         mixed_precision: bool, chunk_tokens: int, world: int,
                         device_memory: int | None = None) -> int | None:
    """``trainer.max_tokens_per_micro_batch`` for this rank: a number or none as set; ``auto``: none
    on CPU (micro-batches of ``algorithm.micro_batch`` rows), on CUDA the memory model's budget for
    ``token_budget_memory_gib`` on this device (its total memory: ``device_memory``, else read
    off the device)."""
    setting = cfg.max_tokens_per_micro_batch
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return None
    if device_memory is None:
        import torch

        device_memory = int(torch.cuda.get_device_properties(device).total_memory)
    return auto_token_budget(shape, policy, device_memory, int(cfg.token_budget_memory_gib * 2**30), world,
                             chunk_logit_bytes=chunk_tokens * shape.vocab * 4, element_bytes=2 if mixed_precision else 4,
                             offload=cfg.optimizer_offload, reference=cfg.algorithm.kl_coef > 0)
