"""What each rollout engine is built with: the simulated engine's ``SimParams`` and ``Clock``
(``staleflow.engines.sim``) and the vLLM engine's ``VllmEngineParams``
(``staleflow.engines.vllm_engine``). A job or instance config's engine sections
(``staleflow.config.instance``) turn into these."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from staleflow.cost_model import CostModel
from staleflow.workload import WorkloadModel, preset


class Clock(StrEnum):
    VIRTUAL = "virtual"
    REAL = "real"


@dataclass(frozen=True)
class SimParams:
    """Everything that shapes one simulated instance. Defaults: paper Table 4 and its 20K workload."""

    cost: CostModel = field(default_factory=CostModel)
    workload: WorkloadModel = field(default_factory=lambda: preset("paper-20k"))
    prefill_seconds_per_token: float = 2e-5
    pull_bandwidth_bytes_per_s: float = 25e9  # PCIe DMA from a co-located parameter server
    pull_latency_s: float = 0.5
    model_bytes: int = 61_000_000_000  # Qwen3-30B-A3B in bf16
    max_running: int = 256  # vLLM's max_num_seqs
    prefill_attention_seconds: float = 0.0  # per (query, key) pair of causal prefill attention
    reprefill: bool = True  # False: only a trajectory's first admission prefills (an upper bound's engine)
    slowdown: float = 1.0  # persistent factor on every step and prefill (a straggler: > 1)
    noise: float = 0.0  # sigma of the log-normal step-latency factor (mean 1)
    noise_block_steps: int = 64  # steps that share one noise draw
    seed: int = 0
    initial_version: int = 0

    def __post_init__(self) -> None:
        if self.prefill_seconds_per_token < 0 or self.prefill_attention_seconds < 0:
            raise ValueError("prefill_seconds_per_token and prefill_attention_seconds must be >= 0")
        if not self.slowdown > 0:
            raise ValueError("slowdown must be > 0")
        if self.pull_bandwidth_bytes_per_s <= 0:
            raise ValueError("pull_bandwidth_bytes_per_s must be > 0")
        if self.pull_latency_s < 0 or self.model_bytes < 0:
            raise ValueError("pull_latency_s and model_bytes must be >= 0")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.noise < 0 or self.noise_block_steps < 1:
            raise ValueError("noise must be >= 0 and noise_block_steps >= 1")
        if self.initial_version < 0:
            raise ValueError("initial_version must be >= 0")

    def pull_seconds(self, size_bytes: int | None = None) -> float:
        size = self.model_bytes if size_bytes is None else size_bytes
        return self.pull_latency_s + size / self.pull_bandwidth_bytes_per_s


@dataclass(frozen=True)
class VllmEngineParams:
    model: str  # a local model directory with config, safetensors and tokenizer
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    seed: int = 0
    enforce_eager: bool = True
    kv_cache_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (CPU builds); None keeps the environment's
    max_num_seqs: int | None = None
    initial_version: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # passed to AsyncEngineArgs as is
