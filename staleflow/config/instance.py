"""A rollout instance's settings: ``InstanceConfig`` with its sim and vLLM engine sections (the
engine they describe is built by ``staleflow.engines.factory.create_engine``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from staleflow.config.common import ServiceConfig
from staleflow.config.cost import CostCoefficients
from staleflow.config.engines import Clock, SimParams
from staleflow.strict import StrictModel
from staleflow.workload import PRESETS, preset

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


class SimConfig(CostCoefficients):
    """Parameters of the simulated engine (see ``staleflow.engines.sim``): its cost-model
    coefficients (inherited, flat: k1..k5, kv_budget) and the rest below."""
    workload: str = "paper-20k"
    workload_seed: int = 0
    prefill_seconds_per_token: float = Field(default=SimParams.prefill_seconds_per_token, ge=0)
    pull_bandwidth_bytes_per_s: float = Field(default=SimParams.pull_bandwidth_bytes_per_s, gt=0)
    pull_latency_s: float = Field(default=SimParams.pull_latency_s, ge=0)
    model_bytes: int = Field(default=SimParams.model_bytes, ge=0)
    max_running: int = Field(default=SimParams.max_running, ge=1)
    noise: float = Field(default=0.0, ge=0)
    noise_block_steps: int = Field(default=SimParams.noise_block_steps, ge=1)
    seed: int = 0
    initial_version: int = Field(default=0, ge=0)
    clock: Clock = Clock.VIRTUAL
    speed: float = Field(default=1.0, gt=0)
    pull_weights: bool = Field(default=False, description="a Pull of a version on a parameter server also pulls its bytes "
                               "from there (verified, then dropped), so holders, relays and reroutes act as for a real "
                               "engine; a refused pull fails the Pull with the server's code. Jobs with "
                               "params.sources: ros turn it on")

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown workload preset {value!r}; choose one of {sorted(PRESETS)}")
        return value

    def params(self) -> SimParams:
        cost = self.cost_model()
        rest = self.model_dump(exclude={"k1", "k2", "k3", "k4", "k5", "kv_budget", "workload", "workload_seed",
                                        "clock", "speed", "pull_weights"})
        return SimParams(cost=cost, workload=preset(self.workload, self.workload_seed), **rest)


class VllmConfig(StrictModel):
    """Parameters of the vLLM engine (see ``staleflow.engines.vllm_engine``)."""

    model: str = Field(min_length=1, description="local model directory (config, safetensors, tokenizer)")
    dtype: str = "bfloat16"
    max_model_len: int = Field(default=4096, ge=1)
    seed: int = 0
    enforce_eager: bool = True
    kv_cache_gib: int | None = Field(default=None, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU builds")
    max_num_seqs: int | None = Field(default=None, ge=1)
    initial_version: int = Field(default=0, ge=0)
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra AsyncEngineArgs")


class InstanceSettings(StrictModel):
    """What a job sets of every rollout instance (its ``instance:`` section)."""

    callback_batch: int = Field(default=64, ge=1, description="completions per callback batch")
    outbox_limit: int = Field(default=100_000, ge=1, description="unacknowledged completions kept before the oldest drop")
    idempotency_window: int = Field(default=10_000, ge=1, description="command ids remembered for retries")
    idempotency_bytes: int = Field(default=8 << 20, ge=1, description="bytes of recorded responses (compact JSON) kept for "
                                   "retries; the oldest go first beyond this or idempotency_window commands")
    progress_tokens: int = Field(default=256, ge=0, description="checkpoint a running trajectory to the trajectory server "
                                 "once it generated this many tokens since its last checkpoint; 0: no checkpoints")
    progress_seconds: float = Field(default=10.0, gt=0, description="checkpoint whatever a running trajectory generated "
                                    "since its last checkpoint at least this often")


class InstanceConfig(InstanceSettings, ServiceConfig):
    """One rollout instance: its id, its engine and where it listens."""

    instance_id: str = Field(pattern=ID_PATTERN)
    engine: Literal["sim", "vllm"] = "sim"
    sim: SimConfig = Field(default_factory=SimConfig)
    vllm: VllmConfig | None = None
    completion_callback_url: str | None = Field(default=None, pattern=r"^https?://")
    progress_url: str | None = Field(default=None, pattern=r"^https?://",
                                     description="POST progress checkpoints here (the trajectory server's /v1/progress)")

    @model_validator(mode="after")
    def _engine_section(self) -> InstanceConfig:
        if self.engine == "vllm" and self.vllm is None:
            raise ValueError("vllm: this section is required when engine is 'vllm' (at least vllm.model)")
        return self
