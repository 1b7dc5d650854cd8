"""The staleness manager's REST app: ``create_app`` over the durable ledger; its wire models are
``staleflow.api.manager``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Path, Query, Request

from staleflow import metrics as m
from staleflow.api.manager import (
    GROUP_ID_PATTERN,
    SQL_INT_MAX,
    AdmissionOut,
    BufferOut,
    BuffersOut,
    ConsumedOut,
    EventsOut,
    Health,
    ReservationOut,
    ReservationRequest,
    TransitionOut,
)
from staleflow.errors import ErrorCode
from staleflow.ledger import AdmissionWhatIf, BufferView, LedgerError, Transition
from staleflow.servers.http import service_app
from staleflow.servers.manager.config import ManagerConfig
from staleflow.servers.manager.store import DurableLedger

log = logging.getLogger(__name__)

GroupId = Annotated[str, Path(pattern=GROUP_ID_PATTERN, description="prompt group id")]


def what_if_json(answer: AdmissionWhatIf) -> dict:
    return {**dataclasses.asdict(answer), "admissible": answer.admissible}


def buffer_json(view: BufferView) -> dict:
    return {
        "version": view.version,
        "state": view.state.value,
        "capacity": view.capacity,
        "entries": [{"group_id": e.group_id, "v_traj": e.v_traj, "status": e.status.value} for e in view.entries],
    }


def transition_json(t: Transition) -> dict:
    body: dict = {"group_id": t.group_id, "buffer": t.buffer, "cancelled": t.cancelled}
    if t.completed_members is not None:
        body["completed_members"] = t.completed_members
        body["occupied"] = t.op == "occupy"
    return body


def ledger_metrics(ledger: DurableLedger) -> list:
    """Prometheus view of the ledger, read at scrape time."""
    version, buffers, counts = ledger.snapshot()
    stats = ledger.stats
    return [
        m.LEDGER_TRAIN_VERSION.value(version),
        m.LEDGER_ENTRIES.family([(["reserved"], counts["reserved"]), (["occupied"], counts["occupied"])]),
        m.LEDGER_BUFFERS.family([([state], sum(b.state.value == state for b in buffers))
                                 for state in ("waiting", "ready", "stuck")]),
        m.LEDGER_ADMITTED.value(stats.admitted),
        m.LEDGER_OCCUPIED.value(stats.occupied),
        m.LEDGER_CONSUMED_GROUPS.value(stats.consumed_groups),
        m.LEDGER_CONSUMED_BUFFERS.value(stats.consumed_buffers),
        m.LEDGER_ABORTED_GROUPS.family([(["requested"], stats.aborted), (["surplus"], stats.surplus)]),
    ]


async def the_ledger(request: Request) -> DurableLedger:
    # async: FastAPI runs a sync dependency in its thread pool, a thread hop on every request
    return request.app.state.ledger


LedgerDep = Annotated[DurableLedger, Depends(the_ledger)]


def create_app(config: ManagerConfig, ledger: DurableLedger | None = None) -> FastAPI:
    """The staleness manager. Owns ``ledger`` if given, else opens the configured database."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = ledger is None
        app.state.ledger = ledger or DurableLedger.open(config.database_url(), config.ledger.params(), config.synchronous,
                                                         config.event_retention)
        log.info("staleness manager ready: eta=%d batch=%d db=%s", config.ledger.eta, config.ledger.batch_size,
                 config.database_url())
        try:
            yield
        finally:
            if owned:
                app.state.ledger.close()

    app = service_app("StaleFlow staleness manager", lifespan)
    m.mount_metrics(app, "manager", lambda: ledger_metrics(app.state.ledger) if hasattr(app.state, "ledger") else [])

    async def transition(led: DurableLedger, name: str, *args: object) -> Transition:
        # awaited on the event loop: no worker-thread hop on the hot path
        return await asyncio.wrap_future(led.submit(name, *args))

    # response_model_exclude_none: fields that only some answers carry are left out

    @app.get("/v1/health", response_model=Health)
    def health(led: LedgerDep) -> dict:
        return {"status": "ok", "train_version": led.train_version}

    @app.get("/v1/buffers", response_model=BuffersOut, response_model_exclude_none=True)
    def buffers(led: LedgerDep) -> dict:
        version, views, _ = led.snapshot()
        return {
            "train_version": version,
            "eta": led.params.eta,
            "batch_size": led.params.batch_size,
            "group_size": led.params.group_size,
            "buffers": [buffer_json(v) for v in views],
        }

    @app.get("/v1/buffers/{version}", response_model=BufferOut, response_model_exclude_none=True)
    def buffer(led: LedgerDep, version: Annotated[int, Path(ge=0, le=SQL_INT_MAX)]) -> dict:
        current, views, _ = led.snapshot()
        for view in views:
            if view.version == version:
                return buffer_json(view)
        if version < current:
            groups = led.consumed_batch(version)
            return {"version": version, "state": "consumed", "capacity": led.params.batch_size,
                    "entries": [{"group_id": g, "status": "consumed"} for g in groups]}
        raise LedgerError(ErrorCode.UNKNOWN_BUFFER,
                          f"buffer {version} is not live yet: live buffers are {current}..{current + led.params.eta}")

    @app.get("/v1/admission", response_model=AdmissionOut)
    def admission(
        led: LedgerDep,
        versions: Annotated[list[int] | None, Query(description="V_traj values to ask about; default all live")] = None,
        version: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX, description=(
            "what if: could `count` more groups with this V_traj be reserved now, and if not, why"))] = None,
        count: Annotated[int | None, Query(ge=1, le=SQL_INT_MAX, description="what if: how many groups (default 1)")]
        = None,
    ) -> dict:
        if count is not None and version is None:
            raise LedgerError(ErrorCode.INVALID_REQUEST, "count needs a version: ask ?version=V&count=N")
        table = led.admission(versions)
        body: dict = {"train_version": led.train_version, "eta": led.params.eta,
                      "admissible": {str(v): n for v, n in table.items()}}
        if version is not None:
            body["what_if"] = what_if_json(led.what_if(version, count or 1))
        return body

    @app.post("/v1/reservations", status_code=201, response_model=TransitionOut, response_model_exclude_none=True)
    async def reserve(led: LedgerDep, body: ReservationRequest) -> dict:
        return transition_json(await transition(led, "reserve", body.group_id, body.v_traj))

    @app.post("/v1/reservations/{group_id}/occupy", response_model=TransitionOut, response_model_exclude_none=True)
    async def occupy(led: LedgerDep, group_id: GroupId) -> dict:
        return transition_json(await transition(led, "occupy", group_id))

    @app.post("/v1/reservations/{group_id}/members/{member_id}/complete", response_model=TransitionOut, response_model_exclude_none=True)
    async def complete_member(led: LedgerDep, group_id: GroupId, member_id: GroupId) -> dict:
        return transition_json(await transition(led, "complete_member", group_id, member_id))

    @app.delete("/v1/reservations/{group_id}", response_model=TransitionOut, response_model_exclude_none=True)
    async def abort(led: LedgerDep, group_id: GroupId) -> dict:
        return transition_json(await transition(led, "abort", group_id))

    @app.get("/v1/reservations/{group_id}", response_model=ReservationOut, response_model_exclude_none=True)
    def reservation(led: LedgerDep, group_id: GroupId) -> dict:
        entry = led.entry(group_id)
        if entry is not None:
            return {"group_id": group_id, "v_traj": entry.v_traj, "status": entry.status.value,
                    "completed_members": list(entry.completed)}
        fate = led.fate(group_id)
        if fate is not None:
            return {"group_id": group_id, "status": fate.value}
        raise LedgerError(ErrorCode.UNKNOWN_GROUP, f"group {group_id!r} is not in the ledger")

    @app.post("/v1/consume", response_model=ConsumedOut)
    async def consume(
        led: LedgerDep,
        version: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX, description=(
            "the buffer the caller means to consume; a retry of an acknowledged consume then replays "
            "its result (replayed: true) instead of consuming the next buffer"))] = None,
    ) -> dict:
        try:
            t = await transition(led, "consume", version)
        except LedgerError as exc:
            if exc.code is not ErrorCode.ALREADY_CONSUMED or version is None:
                raise
            groups = led.consumed_batch(version)
            return {"version": version, "group_ids": groups, "cancelled": [], "replayed": True}
        return {"version": t.buffer, "group_ids": t.consumed, "cancelled": t.cancelled, "replayed": False}

    @app.get("/v1/events", response_model=EventsOut)
    def events(
        led: LedgerDep,
        after: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> dict:
        rows = led.events(after, limit)
        return {"events": rows, "next": rows[-1]["id"] if rows else after}

    return app
