"""Typed configuration. Every model validates its fields and names the fix in its messages."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from staleflow.calibration import CalibrationRef
from staleflow.cost_model import CostModel
from staleflow.ledger import LedgerParams


def _check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(ord(c) < 33 for c in value):
        raise ValueError(f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8350")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
"""An http(s) URL with a host, kept as a string (no trailing slash)."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostConfig(BaseModel):
    """Cost-model coefficients (paper Eq. 2-4, Table 4 defaults; kv in tokens)."""

    model_config = ConfigDict(extra="forbid")
    k1: float = Field(CostModel.k1, ge=0, description="s per KV token read in a decode step")
    k2: float = Field(CostModel.k2, ge=0, description="s, memory-bound GEMM floor")
    k3: float = Field(CostModel.k3, ge=0, description="s per running trajectory when compute-bound")
    k4: float = Field(CostModel.k4, ge=0, description="s, constant per-step overhead")
    k5: float = Field(CostModel.k5, gt=0, description="KV units per token")
    kv_budget: float = Field(CostModel.kv_budget, gt=0, description="KV budget M, in KV units")

    def cost_model(self) -> CostModel:
        return CostModel(**self.model_dump(include=set(CostConfig.model_fields)))


class LedgerConfig(StrictModel):
    eta: int = Field(3, ge=0, description="staleness bound: V_traj + eta >= V_buf for every trajectory")
    batch_size: int = Field(128, ge=1, description="prompt groups per training batch (B)")
    group_size: int = Field(16, ge=1, description="trajectories per prompt group (G)")
    batch_redundancy: float = Field(0.0, ge=0.0, le=4.0, description="extra groups per batch, as a fraction of B")
    group_redundancy: float = Field(0.0, ge=0.0, le=4.0, description="extra trajectories per group, as a fraction of G")

    def params(self) -> LedgerParams:
        return LedgerParams(
            eta=self.eta,
            batch_size=self.batch_size,
            batch_redundancy=self.batch_redundancy,
            group_size=self.group_size,
            group_redundancy=self.group_redundancy,
        )


class ServiceConfig(StrictModel):
    host: str = Field("127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")


class ManagerConfig(ServiceConfig):
    ledger: LedgerConfig = LedgerConfig()
    state_dir: Path = Path(".staleflow")
    db_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite file in the state directory")
    synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="SQLite sync level: FULL survives power loss, NORMAL only process crashes"
    )
    port: int = Field(8321, ge=0, le=65535)

    @model_validator(mode="after")
    def _db_url_scheme(self) -> ManagerConfig:
        if self.db_url is not None and "://" not in self.db_url:
            raise ValueError(f"db_url {self.db_url!r} is not a URL; use e.g. sqlite:///path/ledger.db or postgresql://...")
        return self

    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.state_dir / 'ledger.db').resolve()}"


class TrainerConfig(StrictModel):
    """The simulated trainer: consumes Ready buffers, 'trains' for a modelled time, pushes weights."""

    seconds_per_token: float = Field(2e-6, ge=0, description="simulated training seconds per trained token")
    seconds_per_step: float = Field(0.5, ge=0, description="simulated fixed cost per training step")
    push_bytes: int = Field(1 << 20, ge=1, description="bytes of the parameter blob pushed to the PS each step")


class JobConfig(StrictModel):
    """Everything `staleflow up` runs. The same file drives embedded and multi-process runs."""

    engine: Literal["sim", "vllm"] = "sim"
    steps: int = Field(10, ge=1, description="training steps (buffers consumed) to run")
    state_dir: Path = Path(".staleflow")
    ledger: LedgerConfig = LedgerConfig(eta=2, batch_size=16, group_size=8)
    instances: int = Field(4, ge=1, le=1024, description="rollout instances")
    routing: Literal["throughput", "vanilla"] = "throughput"
    sync: Literal["selective", "greedy", "global"] = "selective"
    migration: Literal["throughput", "none"] = "throughput"
    mu: float = Field(0.3, ge=0, le=1)
    phi_wait: int = Field(3, ge=0)
    phi_throughput: float = Field(5.0, ge=1)
    workload: str = Field("demo", description="sim workload preset: demo, ci-tiny, paper-20k, paper-40k")
    max_tokens: int = Field(2048, ge=1, description="response length limit")
    seed: int = 0
    speed: float = Field(40.0, gt=0, description="sim clock: simulated seconds per real second")
    cycle_period: float = Field(0.05, gt=0, description="coordinator cycle, seconds")
    reward: str = Field("auto", description="auto (sim: 'sim', vllm: the reward server), sim, math or a URL")
    trainer: TrainerConfig = TrainerConfig()
    base_port: int = Field(0, ge=0, le=65000, description="first port of the components; 0 picks free ports")
    host: str = "127.0.0.1"
    processes: bool = Field(False, description="run every component as its own process instead of embedded")
    # issue 10: the coordinator's cost model from a `staleflow calibrate` entry (default: CostConfig's)
    calibration: CalibrationRef | None = Field(None, description="calibration file entry for the coordinator")

    @model_validator(mode="after")
    def _engine_needs(self) -> JobConfig:
        if self.engine == "sim":
            from staleflow.workload import PRESETS

            if self.workload not in PRESETS:
                raise ValueError(f"workload {self.workload!r} is not a sim preset; choose one of {sorted(PRESETS)}")
        return self
