"""The coordinator as a service: ``create_app(config)``; its lifespan owns the cycle loop."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from staleflow.calibration import CalibrationRef, calibrated_cost
from staleflow.config import CostConfig, HttpUrl, ServiceConfig
from staleflow.coordinator.service import Coordinator, InstanceRecord
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.servers.http import service_app
from staleflow.servers.instance.wire import SnapshotOut
from staleflow.strategies import MigrationMode, RoutingMode, StrategyConfig, SyncMode

INSTANCE_ID = r"^[A-Za-z0-9._:@+\-]{1,200}$"


class InstanceEndpoint(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}
    instance_id: str = Field(pattern=INSTANCE_ID)
    url: HttpUrl


class CoordinatorConfig(ServiceConfig):
    manager_url: HttpUrl = "http://127.0.0.1:8321"
    ts_url: HttpUrl
    params_url: HttpUrl | None = None
    instances: list[InstanceEndpoint] = []
    routing: RoutingMode = RoutingMode.THROUGHPUT
    sync: SyncMode = SyncMode.SELECTIVE
    migration: MigrationMode = MigrationMode.THROUGHPUT
    mu: float = Field(0.3, ge=0, le=1)
    phi_wait: int = Field(3, ge=0)
    phi_throughput: float = Field(5.0, ge=1)
    max_in_flight: int | None = Field(None, ge=1, description="in-flight-limited baseline mode")
    cycle_period: float = Field(0.05, gt=0, description="seconds between cycles")
    command_timeout: float = Field(30.0, gt=0)
    failure_timeout: float = Field(10.0, gt=0, description="an instance silent this long is declared failed")
    stall_timeout: float = Field(60.0, ge=0, description="running work with no progress this long: failed (0: never)")
    cost: CostConfig = CostConfig()
    calibration: CalibrationRef | None = Field(
        None, description="take cost from this `staleflow calibrate` entry (instead of giving cost)")
    sim_weights_bytes: int | None = Field(None, ge=0, description="Pull size for sim instances without a PS")

    @model_validator(mode="before")
    @classmethod
    def _cost_from_calibration(cls, data: Any) -> Any:
        return calibrated_cost(data)

    def strategy(self) -> StrategyConfig:
        return StrategyConfig(routing=self.routing, sync=self.sync, migration=self.migration, mu=self.mu,
                              phi_wait=self.phi_wait, phi_throughput=self.phi_throughput,
                              max_in_flight=self.max_in_flight)


class CoordinatorHealth(BaseModel):
    status: str
    cycles: int


class InstanceView(BaseModel):
    """An instance as the coordinator sees it (``Coordinator.describe``)."""

    model_config = ConfigDict(extra="forbid")
    instance_id: str
    url: str
    status: str = Field(description="joining, live, syncing or failed")
    validated: bool
    snapshot: dict[str, Any] | None
    speculative: dict[str, int] | None = Field(description="the speculative state P: inst_version, accum_traj_num")
    estimated_throughput: float
    commands_in_flight: int


class InstancesOut(BaseModel):
    ps_version: int
    instances: list[InstanceView]


class CommandView(BaseModel):
    command_id: str
    instance_id: str
    kind: str
    size: int
    issued_at: float
    completed_at: float | None
    outcome: str


class CommandsOut(BaseModel):
    commands: list[CommandView]


class CoordinatorStatsOut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cycles: int
    accepted_snapshots: int
    discarded_snapshots: int
    last_decision_ms: float
    mean_decision_ms: float
    routed: int
    interrupted: int
    pulls: int
    aborts: int
    failures: int
    rejoined: int
    released: int
    strategy: dict[str, str]


def the_coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


CoordinatorDep = Annotated[Coordinator, Depends(the_coordinator)]


def create_app(config: CoordinatorConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coordinator = Coordinator(
            config.manager_url, config.ts_url, config.strategy(), params_url=config.params_url,
            cycle_period=config.cycle_period, command_timeout=config.command_timeout,
            failure_timeout=config.failure_timeout, stall_timeout=config.stall_timeout,
            sim_weights_bytes=config.sim_weights_bytes,
        )
        for endpoint in config.instances:
            coordinator.add_instance(endpoint.instance_id, endpoint.url, config.cost.cost_model())
        app.state.coordinator = coordinator
        loop = asyncio.create_task(coordinator.run())
        try:
            yield
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await coordinator.close()

    app = service_app("StaleFlow coordinator", lifespan)

    @app.get("/v1/health", response_model=CoordinatorHealth)
    async def health(c: CoordinatorDep) -> dict:
        return {"status": "ok", "cycles": c.stats.cycles}

    @app.get("/v1/instances", response_model=InstancesOut)
    async def instances(c: CoordinatorDep) -> dict:
        return {"ps_version": c.ps_version, "instances": [c.describe(r) for r in c.instances.values()]}

    @app.post("/v1/instances", status_code=201, response_model=InstanceView)
    async def register(c: CoordinatorDep, body: InstanceEndpoint) -> dict:
        return c.describe(c.add_instance(body.instance_id, body.url, config.cost.cost_model()))

    def _record(c: Coordinator, instance_id: str) -> InstanceRecord:
        record = c.instances.get(instance_id)
        if record is None:
            raise StaleFlowError(ErrorCode.UNKNOWN_INSTANCE, f"instance {instance_id!r} is not registered")
        return record

    @app.get("/v1/instances/{instance_id}", response_model=InstanceView)
    async def instance(c: CoordinatorDep, instance_id: str) -> dict:
        return c.describe(_record(c, instance_id))

    @app.get("/v1/instances/{instance_id}/snapshot", response_model=SnapshotOut)
    async def instance_snapshot(c: CoordinatorDep, instance_id: str) -> dict:
        record = _record(c, instance_id)
        if record.snapshot is None:
            raise StaleFlowError(ErrorCode.NO_SNAPSHOT, f"no snapshot of {instance_id!r} yet")
        return record.snapshot

    @app.get("/v1/commands", response_model=CommandsOut)
    async def commands(c: CoordinatorDep, limit: Annotated[int, Query(ge=1, le=2000)] = 50) -> dict:
        recent = list(c.commands)[-limit:]
        return {"commands": [dataclasses.asdict(command) for command in reversed(recent)]}

    @app.get("/v1/coordinator", response_model=CoordinatorStatsOut)
    async def coordinator_stats(c: CoordinatorDep) -> dict:
        s = c.stats
        return {
            "cycles": s.cycles, "accepted_snapshots": s.accepted_snapshots, "discarded_snapshots": s.discarded_snapshots,
            "last_decision_ms": s.last_decision_ms,
            "mean_decision_ms": s.decision_ms_total / s.cycles if s.cycles else 0.0,
            "routed": s.routed, "interrupted": s.interrupted, "pulls": s.pulls, "aborts": s.aborts,
            "failures": s.failures, "rejoined": s.rejoined, "released": s.released,
            "strategy": {k: str(v) for k, v in vars(c.strategy).items()},
        }

    return app
