"""The staleness manager's REST app: ``create_app`` registers the routes ``staleflow.api.manager``
declares, each answered by the ``StalenessManager`` (``service``) over the durable ledger (``store``)."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Depends, FastAPI, Path, Query, Request

from staleflow import metrics as m
from staleflow.api.manager import GROUP_ID_PATTERN, SQL_INT_MAX, ManagerRoutes, ReservationRequest
from staleflow.config import ManagerConfig
from staleflow.servers.http import Owned, handles, service_app
from staleflow.servers.manager.service import StalenessManager
from staleflow.servers.manager.store import DurableLedger

log = logging.getLogger(__name__)

GroupId = Annotated[str, Path(pattern=GROUP_ID_PATTERN, description="prompt group id")]
Version = Annotated[int, Query(ge=0, le=SQL_INT_MAX)]


async def the_manager(request: Request) -> StalenessManager:
    # async: FastAPI runs a sync dependency in its thread pool, a thread hop on every request
    return request.app.state.manager


ManagerDep = Annotated[StalenessManager, Depends(the_manager)]


def create_app(config: ManagerConfig, ledger: DurableLedger | None = None) -> FastAPI:
    """The staleness manager over ``ledger`` if given (its caller closes it), else over the configured
    database (opened at startup, closed at shutdown)."""

    async def open_manager() -> StalenessManager:
        return StalenessManager(DurableLedger.open(config.database_url(), config.ledger.params(), config.synchronous,
                                                   config.event_retention))

    async def close_manager(manager: StalenessManager) -> None:
        manager.ledger.close()

    def ready(_: StalenessManager) -> None:
        log.info("staleness manager ready: eta=%d batch=%d db=%s", config.ledger.eta, config.ledger.batch_size,
                 config.database_url())

    given = StalenessManager(ledger) if ledger is not None else None
    app = service_app("StaleFlow staleness manager", Owned("manager", open_manager, close_manager, given=given,
                                                           ready=ready))
    m.mount_metrics(app, "manager", lambda: app.state.manager.metrics() if hasattr(app.state, "manager") else [])
    optional = {"response_model_exclude_none": True}  # fields that only some answers carry are left out

    @handles(app, ManagerRoutes.health)
    def health(manager: ManagerDep) -> dict:
        return manager.health()

    @handles(app, ManagerRoutes.buffers, **optional)
    def buffers(manager: ManagerDep) -> dict:
        return manager.buffers()

    @handles(app, ManagerRoutes.buffer, **optional)
    def buffer(manager: ManagerDep, version: Annotated[int, Path(ge=0, le=SQL_INT_MAX)]) -> dict:
        return manager.buffer(version)

    @handles(app, ManagerRoutes.admission)
    def admission(
        manager: ManagerDep,
        versions: Annotated[list[int] | None, Query(description="V_traj values to ask about; default all live")] = None,
        version: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX, description=(
            "what if: could `count` more groups with this V_traj be reserved now, and if not, why"))] = None,
        count: Annotated[int | None, Query(ge=1, le=SQL_INT_MAX, description="what if: how many groups (default 1)")]
        = None,
    ) -> dict:
        return manager.admission(versions, version, count)

    @handles(app, ManagerRoutes.reserve, status_code=201, **optional)
    async def reserve(manager: ManagerDep, body: ReservationRequest) -> dict:
        return await manager.transition("reserve", body.group_id, body.v_traj)

    @handles(app, ManagerRoutes.occupy, **optional)
    async def occupy(manager: ManagerDep, group_id: GroupId) -> dict:
        return await manager.transition("occupy", group_id)

    @handles(app, ManagerRoutes.complete_member, **optional)
    async def complete_member(manager: ManagerDep, group_id: GroupId, member_id: GroupId) -> dict:
        return await manager.transition("complete_member", group_id, member_id)

    @handles(app, ManagerRoutes.abort, **optional)
    async def abort(manager: ManagerDep, group_id: GroupId) -> dict:
        return await manager.transition("abort", group_id)

    @handles(app, ManagerRoutes.reservation, **optional)
    def reservation(manager: ManagerDep, group_id: GroupId) -> dict:
        return manager.reservation(group_id)

    @handles(app, ManagerRoutes.consume)
    async def consume(
        manager: ManagerDep,
        version: Annotated[int | None, Query(ge=0, le=SQL_INT_MAX, description=(
            "the buffer the caller means to consume; a retry of an acknowledged consume then replays "
            "its result (replayed: true) instead of consuming the next buffer"))] = None,
    ) -> dict:
        return await manager.consume(version)

    @handles(app, ManagerRoutes.events)
    def events(manager: ManagerDep, after: Version = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
        return manager.events(after, limit)

    return app
