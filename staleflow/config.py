"""Typed configuration. Every model validates its fields and names the fix in its messages."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from staleflow.ledger import LedgerParams


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
