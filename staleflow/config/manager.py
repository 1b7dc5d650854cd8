"""The staleness manager's settings: the ledger's parameters (``LedgerParams``, what
``staleflow.ledger.Ledger`` runs with, and ``LedgerConfig``, their settings) and where its durable
state lives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from staleflow.config.common import STATE_DIR, ServiceConfig, check_database_url
from staleflow.strict import StrictModel

MANAGER_PORT = 8321
MANAGER_URL = f"http://127.0.0.1:{MANAGER_PORT}"
"""Where the other components find the manager unless told otherwise."""


@dataclass(frozen=True)
class LedgerParams:
    eta: int
    batch_size: int
    batch_redundancy: float = 0.0
    group_size: int = 1
    group_redundancy: float = 0.0

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError("eta (staleness bound) must be >= 0")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")
        if self.batch_redundancy < 0 or self.group_redundancy < 0:
            raise ValueError("redundancy ratios must be >= 0")

    @cached_property
    def capacity(self) -> int:
        """Groups admitted per buffer window (B plus batch-level redundancy)."""
        return self.batch_size + math.floor(self.batch_size * self.batch_redundancy + 1e-9)

    @property
    def group_members(self) -> int:
        """Trajectories generated per group (G plus group-level redundancy)."""
        return self.group_size + math.floor(self.group_size * self.group_redundancy + 1e-9)


class LedgerConfig(StrictModel):
    eta: int = Field(default=3, ge=0, description="staleness bound: V_traj + eta >= V_buf for every trajectory")
    batch_size: int = Field(default=128, ge=1, description="prompt groups per training batch (B)")
    group_size: int = Field(default=16, ge=1, description="trajectories per prompt group (G)")
    batch_redundancy: float = Field(default=0.0, ge=0.0, le=4.0, description="extra groups per batch, as a fraction of B")
    group_redundancy: float = Field(default=0.0, ge=0.0, le=4.0, description="extra trajectories per group, as a fraction of G")

    def params(self) -> LedgerParams:
        return LedgerParams(
            eta=self.eta,
            batch_size=self.batch_size,
            batch_redundancy=self.batch_redundancy,
            group_size=self.group_size,
            group_redundancy=self.group_redundancy,
        )


class ManagerSettings(StrictModel):
    """What a job sets of the manager (its ``manager:`` section)."""

    synchronous: Literal["FULL", "NORMAL"] = Field(
        default="FULL", description="SQLite sync level: FULL survives power loss, NORMAL only process crashes"
    )
    event_retention: int = Field(
        default=10_000, ge=0, description="ledger events kept besides those of live groups and consume events: older events "
                                  "of retired groups are compacted away (counted) at each consume (0: keep every event)")


class ManagerConfig(ManagerSettings, ServiceConfig):
    ledger: LedgerConfig = LedgerConfig()
    state_dir: Path = STATE_DIR
    db_url: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite file in the state directory")
    port: int = Field(default=MANAGER_PORT, ge=0, le=65535)

    _db_url_supported = field_validator("db_url")(check_database_url)

    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.state_dir / 'ledger.db').resolve()}"
