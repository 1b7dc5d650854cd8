"""The coordinator as a service: ``create_app(config)``; its lifespan owns the cycle loop."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, FastAPI, Path, Query, Request

from staleflow import metrics as m
from staleflow.api.coordinator import CoordinatorRoutes, InstanceView
from staleflow.api.instance import SnapshotOut
from staleflow.calibration.files import resolved_cost
from staleflow.config.coordinator import INSTANCE_ID, CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.explain import explain, explanation_json
from staleflow.coordinator.service import Coordinator, InstanceRecord, InstanceStatus
from staleflow.cost_model import CostModel
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.servers.http import Owned, background, handles, service_app

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
        m.COORDINATOR_ESTIMATED_THROUGHPUT.family([([d.instance_id], d.estimated_throughput)
                                                   for d in map(c.describe, c.instances.values())]),
    ]


async def the_coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


CoordinatorDep = Annotated[Coordinator, Depends(the_coordinator)]


def create_app(config: CoordinatorConfig) -> FastAPI:
    """The coordinator's app. The calibration file ``config`` names is read here, where the service
    starts (``CalibrationError`` naming the problem if it cannot be used)."""
    cost = resolved_cost(config.cost, config.calibration).cost_model()

    async def open_coordinator() -> Coordinator:
        coordinator = Coordinator(
            config.manager_url, config.ts_url, config.strategy, params_url=config.params_url,
            cycle_period=config.cycle_period, command_timeout=config.command_timeout,
            failure_timeout=config.failure_timeout, stall_timeout=config.stall_timeout,
            reconcile_after=config.reconcile_after,
            sim_weights_bytes=config.sim_weights_bytes,
        )
        for endpoint in config.instances:
            coordinator.add_instance(endpoint.instance_id, endpoint.url, cost, endpoint.params_url)
        return coordinator

    async def close_coordinator(coordinator: Coordinator) -> None:
        await coordinator.close()

    app = service_app("StaleFlow coordinator", Owned("coordinator", open_coordinator, close_coordinator,
                                                     running=lambda _, coordinator: background(coordinator.run())))
    m.mount_metrics(app, "coordinator",
                    lambda: coordinator_metrics(app.state.coordinator) if hasattr(app.state, "coordinator") else [])

    @handles(app, CoordinatorRoutes.health)
    async def health(c: CoordinatorDep) -> dict:
        return {"status": "ok", "cycles": c.stats.cycles}

    @handles(app, CoordinatorRoutes.commands)
    async def commands(c: CoordinatorDep, limit: Annotated[int, Query(ge=1, le=2000)] = 50) -> dict:
        recent = list(c.commands)[-limit:]
        return {"commands": [dataclasses.asdict(command) for command in reversed(recent)]}

    @handles(app, CoordinatorRoutes.explain_buffer)
    async def explain_buffer(c: CoordinatorDep, version: Annotated[int, Path(ge=0, le=2**63 - 1)]) -> dict:
        """Why the buffer is not consumable yet: the groups it waits for, where their trajectories are
        and how far they got, and when the cost model expects it ready."""
        return explanation_json(await explain(c, version))

    @handles(app, CoordinatorRoutes.stats)
    async def coordinator_stats(c: CoordinatorDep) -> dict:
        s = c.stats
        return {
            "cycles": s.cycles, "accepted_snapshots": s.accepted_snapshots, "discarded_snapshots": s.discarded_snapshots,
            "last_decision_ms": s.last_decision_ms,
            "mean_decision_ms": s.decision_ms_total / s.cycles if s.cycles else 0.0,
            "decisions": s.decisions, "decision_ms_total": s.decision_ms_total,
            "command_count": s.command_count, "command_seconds": s.command_seconds,
            "routed": s.routed, "interrupted": s.interrupted, "pulls": s.pulls, "aborts": s.aborts,
            "failures": s.failures, "rejoined": s.rejoined, "released": s.released,
            "reconciled": s.reconciled, "strays_aborted": s.strays_aborted, "rerouted_pulls": s.rerouted_pulls,
            "unreachable": s.unreachable, "cycle_ms_total": s.cycle_ms_total, "phase_ms_total": s.phase_ms_total,
            "strategy": {k: str(v) for k, v in vars(c.strategy).items()},
        }

    @handles(app, CoordinatorRoutes.learning)
    async def learning(c: CoordinatorDep) -> dict:
        """What the coordinator learned as the job runs (finished lengths, decode speeds) and the
        newest ``pull: auto`` choices with the inputs each was made from."""
        return {"lengths": c.lengths.state() if c.lengths is not None else None,
                "speeds": {i: c.speeds.speed(i) for i in c.instances},
                "pull_decisions": [dataclasses.asdict(d) for d in c.pull_decisions]}

    _add_instance_routes(app, cost)
    return app


def _add_instance_routes(app: FastAPI, cost: CostModel) -> None:
    """The instance pool: listing, registering, re-pointing and removing instances."""

    @handles(app, CoordinatorRoutes.instances)
    async def instances(c: CoordinatorDep) -> dict:
        return {"ps_version": c.ps_version, "instances": [c.describe(r) for r in c.instances.values()]}

    @handles(app, CoordinatorRoutes.register, status_code=201)
    async def register(c: CoordinatorDep, body: InstanceEndpoint) -> InstanceView:
        return c.describe(c.add_instance(body.instance_id, body.url, cost, body.params_url))

    @handles(app, CoordinatorRoutes.upsert)
    async def upsert(c: CoordinatorDep, instance_id: str, body: InstanceEndpoint) -> InstanceView:
        """Register the instance or re-point it at a new URL (it moved to another machine)."""
        if body.instance_id != instance_id:
            raise StaleFlowError(ErrorCode.INVALID_REQUEST,
                                 f"the body names {body.instance_id!r}, the path {instance_id!r}")
        return c.describe(await c.upsert_instance(instance_id, body.url, cost, body.params_url))

    def _record(c: Coordinator, instance_id: str) -> InstanceRecord:
        record = c.instances.get(instance_id)
        if record is None:
            raise StaleFlowError(ErrorCode.UNKNOWN_INSTANCE, f"instance {instance_id!r} is not registered")
        return record

    @handles(app, CoordinatorRoutes.instance)
    async def instance(c: CoordinatorDep, instance_id: str) -> InstanceView:
        return c.describe(_record(c, instance_id))

    @handles(app, CoordinatorRoutes.remove)
    async def remove(c: CoordinatorDep, instance_id: str) -> dict:
        """Take the instance out of the pool; what was routed to it goes back to pending."""
        return {"instance_id": instance_id, "released": await c.remove_instance(instance_id)}

    @handles(app, CoordinatorRoutes.instance_snapshot)
    async def instance_snapshot(c: CoordinatorDep, instance_id: str) -> SnapshotOut:
        record = _record(c, instance_id)
        if record.snapshot is None:
            raise StaleFlowError(ErrorCode.NO_SNAPSHOT, f"no snapshot of {instance_id!r} yet")
        return record.snapshot
