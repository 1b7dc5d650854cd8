"""The coordinator as a service: ``create_app(config)``; its lifespan owns the cycle loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from staleflow.calibration import CalibrationRef, calibrated_cost
from staleflow.config import CostConfig, HttpUrl, ServiceConfig
from staleflow.coordinator.service import Coordinator
from staleflow.strategies import MigrationMode, RoutingMode, StrategyConfig, SyncMode

INSTANCE_ID = r"^[A-Za-z0-9._:@+\-]{1,200}$"


class InstanceEndpoint(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}
    instance_id: str = Field(pattern=INSTANCE_ID)
    url: HttpUrl
    params_url: HttpUrl | None = Field(None, description="where this instance pulls weights (a parameter-server "
                                                         "relay on its machine); default: the job's parameter server")


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
            coordinator.add_instance(endpoint.instance_id, endpoint.url, config.cost.cost_model(), endpoint.params_url)
        app.state.coordinator = coordinator
        loop = asyncio.create_task(coordinator.run())
        try:
            yield
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await coordinator.close()

    app = FastAPI(title="StaleFlow coordinator", version="1", lifespan=lifespan)

    def co(request: Request) -> Coordinator:
        return request.app.state.coordinator

    @app.get("/v1/health")
    async def health(request: Request) -> dict:
        return {"status": "ok", "cycles": co(request).stats.cycles}

    @app.get("/v1/instances")
    async def instances(request: Request) -> dict:
        c = co(request)
        return {"ps_version": c.ps_version, "instances": [c.describe(r) for r in c.instances.values()]}

    @app.post("/v1/instances", status_code=201)
    async def register(request: Request, body: InstanceEndpoint) -> dict:
        c = co(request)
        try:
            record = c.add_instance(body.instance_id, body.url, config.cost.cost_model(), body.params_url)
        except ValueError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=409)
        return c.describe(record)

    @app.put("/v1/instances/{instance_id}")
    async def upsert(request: Request, instance_id: str, body: InstanceEndpoint) -> Any:
        """Register the instance or re-point it at a new URL (it moved to another machine)."""
        if body.instance_id != instance_id:
            return JSONResponse({"detail": f"the body names {body.instance_id!r}, the path {instance_id!r}"},
                                status_code=422)
        return co(request).describe(await co(request).upsert_instance(instance_id, body.url, config.cost.cost_model(),
                                                                      body.params_url))

    def _record(request: Request, instance_id: str):  # noqa: ANN202
        record = co(request).instances.get(instance_id)
        if record is None:
            return None, JSONResponse({"detail": f"instance {instance_id!r} is not registered"}, status_code=404)
        return record, None

    @app.get("/v1/instances/{instance_id}")
    async def instance(request: Request, instance_id: str) -> dict:
        record, missing = _record(request, instance_id)
        return missing or co(request).describe(record)

    @app.get("/v1/instances/{instance_id}/snapshot")
    async def instance_snapshot(request: Request, instance_id: str) -> dict:
        record, missing = _record(request, instance_id)
        if missing:
            return missing
        if record.snapshot is None:
            return JSONResponse({"detail": f"no snapshot of {instance_id!r} yet"}, status_code=404)
        return record.snapshot

    @app.get("/v1/commands")
    async def commands(request: Request, limit: Annotated[int, Query(ge=1, le=2000)] = 50) -> dict:
        recent = list(co(request).commands)[-limit:]
        return {"commands": [
            {"command_id": c.command_id, "instance_id": c.instance_id, "kind": c.kind, "size": c.size,
             "issued_at": c.issued_at, "completed_at": c.completed_at, "outcome": c.outcome} for c in reversed(recent)]}

    @app.get("/v1/coordinator")
    async def coordinator_stats(request: Request) -> dict:
        s = co(request).stats
        return {
            "cycles": s.cycles, "accepted_snapshots": s.accepted_snapshots, "discarded_snapshots": s.discarded_snapshots,
            "last_decision_ms": s.last_decision_ms,
            "mean_decision_ms": s.decision_ms_total / s.cycles if s.cycles else 0.0,
            "routed": s.routed, "interrupted": s.interrupted, "pulls": s.pulls, "aborts": s.aborts,
            "failures": s.failures, "rejoined": s.rejoined, "released": s.released, "strategy": {k: str(v) for k, v in vars(co(request).strategy).items()},
        }

    return app
