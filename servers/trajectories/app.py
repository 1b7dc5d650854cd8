"""The trajectory server's REST app: ``create_app`` wires ``TrajectoryServer`` to the endpoints."""

from __future__ import annotations

import logging
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse

from staleflow.api.base import ServiceError
from staleflow.api.trajectories import (
    AckRequest,
    BatchOut,
    CancellationsOut,
    CheckedOut,
    CheckoutRequest,
    CompletedRequest,
    ProgressRequest,
    ReleaseRequest,
    ReturnRequest,
    TrajectoriesOut,
    TrajectoryDetail,
    TrajectoryPage,
    TrajectoryRoutes,
)
from staleflow.config import TrajectoryServerConfig
from staleflow.errors import ErrorCode, error_body
from staleflow.metrics import mount_metrics
from staleflow.servers.http import Owned, error_response, handles, service_app
from staleflow.servers.trajectories.rewards import RewardFn, make_reward
from staleflow.servers.trajectories.service import TrajectoryServer
from staleflow.servers.trajectories.store import TrajState

log = logging.getLogger(__name__)


async def the_server(request: Request) -> TrajectoryServer:
    return request.app.state.ts


ServerDep = Annotated[TrajectoryServer, Depends(the_server)]


def create_app(config: TrajectoryServerConfig, reward: RewardFn | None = None) -> FastAPI:
    async def open_server() -> TrajectoryServer:
        return TrajectoryServer.open(config, reward or make_reward(config))

    async def close_server(server: TrajectoryServer) -> None:
        await server.aclose()

    app = service_app("StaleFlow trajectory server",
                      Owned("ts", open_server, close_server, running=lambda _, server: server.running()))
    mount_metrics(app, "ts", lambda: app.state.ts.metrics() if hasattr(app.state, "ts") else [])

    @app.exception_handler(ServiceError)
    async def _upstream(_: Request, exc: ServiceError) -> JSONResponse:
        # the manager's refusal of what the client asked (e.g. an unknown buffer) is the client's 4xx,
        # with the manager's code
        if 400 <= exc.status < 500 and exc.code is not None:
            return JSONResponse({**exc.body, **error_body(exc.code, f"staleness manager: {exc.detail}")},
                                status_code=exc.status)
        return error_response(ErrorCode.UPSTREAM_ERROR, f"staleness manager: {exc.detail}", upstream_status=exc.status)

    @app.exception_handler(httpx.TransportError)
    async def _unreachable(_: Request, exc: httpx.TransportError) -> JSONResponse:
        return error_response(ErrorCode.UPSTREAM_UNAVAILABLE, f"staleness manager unreachable: {exc.__class__.__name__}")

    _add_instance_routes(app)
    _add_trainer_routes(app)
    return app


def _add_instance_routes(app: FastAPI) -> None:
    """What the coordinator and the instances call: routing, results, failover and cancellation."""

    @handles(app, TrajectoryRoutes.pending)
    async def pending(server: ServerDep) -> TrajectoriesOut:
        """Trajectories waiting to be routed, for the coordinator (V_traj null: initial)."""
        return server.pending()

    @handles(app, TrajectoryRoutes.finished_lengths)
    async def finished_lengths(server: ServerDep, after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
                               limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> dict:
        """The lengths of completed trajectories after id ``after``, oldest first, for the
        coordinator's length predictor: each completion once, in the transaction that accepted it;
        the newest ``finished_lengths_kept`` are kept."""
        return server.store.finished_lengths(after, limit)

    @handles(app, TrajectoryRoutes.routed)
    async def routed(server: ServerDep, instance_id: str | None = None) -> TrajectoriesOut:
        return server.routed(instance_id)

    @handles(app, TrajectoryRoutes.checkout)
    async def checkout(server: ServerDep, body: CheckoutRequest) -> CheckedOut:
        return await server.checkout(body)

    @handles(app, TrajectoryRoutes.give_back)
    async def give_back(server: ServerDep, body: ReturnRequest) -> dict:
        server.check_vocabulary(body.partials)
        return {"outcome": await server.returned(body)}

    @handles(app, TrajectoryRoutes.completed)
    async def completed(server: ServerDep, body: CompletedRequest) -> dict:
        server.check_vocabulary(item.trajectory for item in body.items)
        return {"accepted": await server.completed(body)}

    @handles(app, TrajectoryRoutes.progress)
    async def progress(server: ServerDep, body: ProgressRequest) -> dict:
        """Progress checkpoints of trajectories running on an instance, appended durably: a
        trajectory handed back from a failed instance resumes from its last checkpoint."""
        server.check_vocabulary(body.trajectories)
        return await server.progress(body)

    @handles(app, TrajectoryRoutes.release)
    async def release(server: ServerDep, instance_id: str, body: ReleaseRequest | None = None) -> dict:
        """The coordinator declared the instance failed: its trajectories become routable again.
        What they held there beyond their checkpoints (the coordinator's last snapshot, or the
        instance's last word if more) is counted as regenerated, once, durably."""
        return server.release(instance_id, body.generated if body else {})

    @handles(app, TrajectoryRoutes.cancellations)
    async def cancellations(server: ServerDep) -> CancellationsOut:
        return server.cancellations()

    @handles(app, TrajectoryRoutes.cancellations_ack)
    async def cancellations_ack(server: ServerDep, body: AckRequest) -> dict:
        return server.cancellations_done(body.traj_ids)


def _add_trainer_routes(app: FastAPI) -> None:
    """What the trainer and operators call: health, batches and the trajectories themselves."""

    @handles(app, TrajectoryRoutes.health)
    async def health(server: ServerDep) -> dict:
        return server.health()

    @handles(app, TrajectoryRoutes.length_skew)
    async def length_skew(server: ServerDep, after_step: Annotated[int, Query(ge=-1)] = -1) -> dict:
        """What the staleness bound did to the response lengths since this server started: what was
        generated against what was trained, what was cut, staleness and admission waits by length
        bucket, per training step after ``after_step`` (``staleflow.length_skew``)."""
        return server.store.length_skew(after_step)

    @handles(app, TrajectoryRoutes.batch)
    async def batch(server: ServerDep, version: Annotated[int, Path(ge=0)]) -> BatchOut:
        return await server.batch(version)

    @handles(app, TrajectoryRoutes.free_batch)
    async def free_batch(server: ServerDep, version: int) -> dict:
        return await server.free_batch(version)

    @handles(app, TrajectoryRoutes.trajectories)
    async def trajectories(
        server: ServerDep,
        state: TrajState | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> TrajectoryPage:
        return server.trajectories(state, limit, offset)

    @handles(app, TrajectoryRoutes.trajectory)
    async def trajectory(server: ServerDep, traj_id: str) -> TrajectoryDetail:
        return server.trajectory(traj_id)
