"""The coordinator as a service: ``create_app(config)``; its lifespan owns the cycle loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from staleflow import metrics as m
from staleflow.config.coordinator import INSTANCE_ID, CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.service import Coordinator, InstanceStatus

__all__ = ["INSTANCE_ID", "CoordinatorConfig", "InstanceEndpoint", "create_app"]


def coordinator_metrics(c: Coordinator) -> list:
    """Prometheus view of the coordinator, read at scrape time."""
    s = c.stats
    statuses = [r.status for r in c.instances.values()]
    return [
        m.COORDINATOR_CYCLES.value(s.cycles),
        m.COORDINATOR_DECISION_SECONDS.summary([((), s.decisions, s.decision_ms_total / 1e3)]),
        m.COORDINATOR_SNAPSHOTS.family([(["accepted"], s.accepted_snapshots), (["discarded"], s.discarded_snapshots)]),
        m.COORDINATOR_COMMAND_SECONDS.summary([([kind], n, s.command_seconds.get(kind, 0.0))
                                               for kind, n in sorted(s.command_count.items())]),
        m.COORDINATOR_TRAJECTORIES.family([(["routed"], s.routed), (["interrupted"], s.interrupted),
                                           (["aborted"], s.aborts)]),
        m.COORDINATOR_PULLS.value(s.pulls),
        m.COORDINATOR_INSTANCES.family([([status.value], statuses.count(status)) for status in InstanceStatus]),
        m.COORDINATOR_FAILURES.value(s.failures),
        m.COORDINATOR_PS_VERSION.value(c.ps_version),
        m.COORDINATOR_ESTIMATED_THROUGHPUT.family([([d["instance_id"]], d["estimated_throughput"])
                                                   for d in map(c.describe, c.instances.values())]),
    ]


def create_app(config: CoordinatorConfig) -> FastAPI:
    """The coordinator's app. The calibration file ``config`` names is read here, where the service
    starts (``CalibrationError`` naming the problem if it cannot be used)."""
    cost = config.resolved_cost().cost_model()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        coordinator = Coordinator(
            config.manager_url, config.ts_url, config.strategy, params_url=config.params_url,
            cycle_period=config.cycle_period, command_timeout=config.command_timeout,
            failure_timeout=config.failure_timeout, stall_timeout=config.stall_timeout,
            sim_weights_bytes=config.sim_weights_bytes,
        )
        for endpoint in config.instances:
            coordinator.add_instance(endpoint.instance_id, endpoint.url, cost)
        app.state.coordinator = coordinator
        loop = asyncio.create_task(coordinator.run())
        try:
            yield
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await coordinator.close()

    app = FastAPI(title="StaleFlow coordinator", version="1", lifespan=lifespan)
    m.mount_metrics(app, "coordinator",
                    lambda: coordinator_metrics(app.state.coordinator) if hasattr(app.state, "coordinator") else [])

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
            record = c.add_instance(body.instance_id, body.url, cost)
        except ValueError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=409)
        return c.describe(record)

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
            "decisions": s.decisions, "decision_ms_total": s.decision_ms_total,
            "command_count": s.command_count, "command_seconds": s.command_seconds,
            "routed": s.routed, "interrupted": s.interrupted, "pulls": s.pulls, "aborts": s.aborts,
            "failures": s.failures, "rejoined": s.rejoined, "released": s.released, "strategy": {k: str(v) for k, v in vars(co(request).strategy).items()},
        }

    return app
