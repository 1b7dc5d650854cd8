"""The vLLM engine settings ``staleflow calibrate`` derives from the model and the machine, so the
command works on first contact (docs/calibrate.md, "Defaults"). Pure: the caller reads the model's
``config.json`` and the free memory.

* ``max_model_len``: the model's positions (``max_position_embeddings``) at most; asked for more,
  vLLM refuses to start, so that is refused here, with the fix.
* CPU builds only: the KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB). Without it vLLM's CPU worker
  claims ``gpu_memory_utilization`` (0.92) of the node's memory and refuses to start unless that much
  is free. The cache is sized for the profiling grid (its largest running count, each trajectory at
  ``max_model_len``), at least 1 GiB and at most half the memory free now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from staleflow.calibration.fit import CalibrationError

DEFAULT_MAX_MODEL_LEN = 4096  # when the model's config does not say how many positions it has
FREE_MEMORY_SHARE = 0.5  # of the memory free now, the most the KV cache may take
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
GIB = 2**30


class EngineSetupError(CalibrationError):
    """Settings the engine would refuse to start with; ``fix`` says what to change."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


@dataclass(frozen=True)
class VllmSettings:
    max_model_len: int
    kv_cache_gib: int | None  # None: the environment's (a GPU build, or VLLM_CPU_KVCACHE_SPACE set)
    notes: tuple[str, ...] = ()  # what was derived, in words


def model_positions(config: Mapping[str, Any]) -> int | None:
    """How many positions the model has, from its Hugging Face config (None: it does not say)."""
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vllm_settings(config: Mapping[str, Any], *, max_model_len: int | None, kv_cache_gib: int | None,
                  kv_bytes_per_token: float | None, largest_n: int, cpu: bool, kv_space_set: bool,
                  free_bytes: int | None, kv_fill: float = 0.85) -> VllmSettings:
    """The settings to start vLLM with: those given, the rest derived (see the module docstring).
    ``kv_space_set``: VLLM_CPU_KVCACHE_SPACE is already in the environment. Raises
    ``EngineSetupError`` for settings vLLM would refuse."""
    notes = []
    positions = model_positions(config)
    if max_model_len is None:
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions or DEFAULT_MAX_MODEL_LEN)
        notes.append(f"max_model_len {max_model_len}" + (f" (the model has {positions} positions)" if positions else ""))
    elif max_model_len < 1:
        raise EngineSetupError(f"--max-model-len must be >= 1, got {max_model_len}", "leave it out: the model's "
                               "positions are the default")
    elif positions is not None and max_model_len > positions:
        raise EngineSetupError(f"--max-model-len {max_model_len} is more than the model's {positions} positions "
                               "(max_position_embeddings in its config.json); vLLM would refuse to start",
                               f"pass --max-model-len {positions} or less, or leave it out")
    if kv_cache_gib is not None:
        if kv_cache_gib < 1:
            raise EngineSetupError(f"--kv-cache-gib must be >= 1, got {kv_cache_gib}", "leave it out: it is sized "
                                   "from the model and the free memory")
        return VllmSettings(max_model_len, kv_cache_gib, tuple(notes))
    if not cpu or kv_space_set:
        return VllmSettings(max_model_len, None, tuple(notes))
    wanted = 1
    if kv_bytes_per_token:
        wanted = max(1, math.ceil(largest_n * max_model_len * kv_bytes_per_token / kv_fill / GIB))
    if free_bytes is not None:
        room = math.floor(FREE_MEMORY_SHARE * free_bytes / GIB)
        if room < 1:
            raise EngineSetupError(
                f"only {free_bytes / GIB:.1f} GiB of memory is free: too little for a KV cache of 1 GiB beside "
                "the model", "free memory (stop other jobs) or pass --kv-cache-gib 1 to try anyway")
        if room < wanted:
            notes.append(f"the profiling grid would fill {wanted} GiB of KV cache; {room} GiB is half the free "
                         "memory: its largest points are left out")
        wanted = min(wanted, room)
    notes.append(f"KV cache {wanted} GiB" + (f" ({free_bytes / GIB:.1f} GiB free)" if free_bytes is not None else ""))
    return VllmSettings(max_model_len, wanted, tuple(notes))
