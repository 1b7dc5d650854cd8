"""The trajectory server's REST app: ``create_app`` wires ``TrajectoryServer`` to the endpoints."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse

from staleflow.api.base import ServiceError
from staleflow.api.manager import AsyncManagerClient
from staleflow.api.trajectories import (
    Accepted,
    Acknowledged,
    AckRequest,
    BatchOut,
    CancellationsOut,
    CheckedOut,
    CheckoutRequest,
    CompletedRequest,
    Freed,
    LengthSkewOut,
    ProgressOut,
    ProgressRequest,
    Released,
    ReleaseRequest,
    Returned,
    ReturnRequest,
    TrajectoriesOut,
    TrajectoryDetail,
    TrajectoryPage,
    TrajectoryServerHealth,
)
from staleflow.errors import ErrorCode, StaleFlowError, error_body
from staleflow.metrics import mount_metrics
from staleflow.servers.http import error_response, service_app
from staleflow.servers.trajectories.config import TrajectoryServerConfig
from staleflow.servers.trajectories.rewards import RewardFn, make_reward
from staleflow.servers.trajectories.service import TrajectoryServer
from staleflow.servers.trajectories.store import TrajectoryStore, TrajState
from staleflow.servers.trajectories.wire import summary, traj_payload
from staleflow.tasks import SkippedRows

log = logging.getLogger(__name__)


async def the_server(request: Request) -> TrajectoryServer:
    return request.app.state.ts


ServerDep = Annotated[TrajectoryServer, Depends(the_server)]


def create_app(config: TrajectoryServerConfig, reward: RewardFn | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = TrajectoryStore.open(config.database_url(), retention=config.retention)
        manager = AsyncManagerClient(config.manager_url)
        server = TrajectoryServer(config, store, manager, reward or make_reward(config))
        server.refill()
        app.state.ts = server
        tasks = [asyncio.create_task(server.reward_loop()), asyncio.create_task(server.follow_ledger())]
        server._work.set()  # reward anything completed before a restart
        try:
            yield
        finally:
            server._stopping = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await manager.aclose()
            store.close()

    app = service_app("StaleFlow trajectory server", lifespan)
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

    @app.get("/v1/health", response_model=TrajectoryServerHealth)
    async def health(server: ServerDep) -> dict:
        """Answers from memory, never from the database: while the database is down it says so
        (``degraded``, naming the dependency) instead of failing, so the server is not taken for hung."""
        skipped = getattr(server.prompts, "skipped", SkippedRows())
        down = server.store.unavailable
        return {"status": "degraded" if down else "ok", "counts": server.store.counts_in_memory(),
                "dependencies": {"database": f"unavailable: {down}"} if down else {},
                "skipped_prompts": {"count": skipped.count + server.too_long.count,
                                    "reasons": {**skipped.reasons, **server.too_long.reasons}},
                "progress": {"checkpointed_tokens": server.checkpointed_tokens,
                             "failed_over": server.store.failed_over[0], "resumed_tokens": server.store.failed_over[1],
                             "regenerated_trajectories": server.store.book.regenerated[0],
                             "regenerated_tokens": server.store.book.regenerated[1]},
                "staleness_violations": server.staleness_violations()}

    @app.get("/v1/length-skew", response_model=LengthSkewOut)
    async def length_skew(server: ServerDep, after_step: Annotated[int, Query(ge=-1)] = -1) -> dict:
        """What the staleness bound did to the response lengths since this server started: what was
        generated against what was trained, what was cut, staleness and admission waits by length
        bucket, per training step after ``after_step`` (``staleflow.length_skew``)."""
        return server.store.length_skew(after_step)

    @app.get("/v1/pending", response_model=TrajectoriesOut)
    async def pending(server: ServerDep) -> dict:
        """Trajectories waiting to be routed, for the coordinator (V_traj null: initial)."""
        return {"trajectories": [summary(t, g) for t, g in server.store.pending()]}

    @app.get("/v1/routed", response_model=TrajectoriesOut)
    async def routed(server: ServerDep, instance_id: str | None = None) -> dict:
        return {"trajectories": [summary(t, g) for t, g in server.store.routed(instance_id)]}

    @app.post("/v1/checkout", response_model=CheckedOut)
    async def checkout(server: ServerDep, body: CheckoutRequest) -> dict:
        return await server.checkout(body)

    @app.post("/v1/return", response_model=Returned)
    async def give_back(server: ServerDep, body: ReturnRequest) -> dict:
        server.check_vocabulary(body.partials)
        return {"outcome": await server.returned(body)}

    @app.post("/v1/completed", response_model=Accepted)
    async def completed(server: ServerDep, body: CompletedRequest) -> dict:
        server.check_vocabulary(item.trajectory for item in body.items)
        return {"accepted": await server.completed(body)}

    @app.post("/v1/progress", response_model=ProgressOut)
    async def progress(server: ServerDep, body: ProgressRequest) -> dict:
        """Progress checkpoints of trajectories running on an instance, appended durably: a
        trajectory handed back from a failed instance resumes from its last checkpoint."""
        server.check_vocabulary(body.trajectories)
        return await server.progress(body)

    @app.post("/v1/instances/{instance_id}/release", response_model=Released)
    async def release(server: ServerDep, instance_id: str, body: ReleaseRequest | None = None) -> dict:
        """The coordinator declared the instance failed: its trajectories become routable again.
        What they held there beyond their checkpoints (the coordinator's last snapshot, or the
        instance's last word if more) is counted as regenerated, once, durably."""
        return {"released": server.store.release_instance(instance_id, body.generated if body else {})}

    @app.get("/v1/cancellations", response_model=CancellationsOut)
    async def cancellations(server: ServerDep) -> dict:
        return {"trajectories": [{"traj_id": t.traj_id, "instance_id": t.instance_id}
                                 for t in server.store.cancellations()]}

    @app.post("/v1/cancellations/ack", response_model=Acknowledged)
    async def cancellations_ack(server: ServerDep, body: AckRequest) -> dict:
        server.store.cancelled(body.traj_ids)
        return {"acknowledged": len(body.traj_ids)}

    @app.get("/v1/batches/{version}", response_model=BatchOut)
    async def batch(server: ServerDep, version: Annotated[int, Path(ge=0)]) -> dict:
        return await server.batch(version)

    @app.delete("/v1/batches/{version}", response_model=Freed)
    async def free_batch(server: ServerDep, version: int) -> dict:
        buffer = await server.manager.buffer(version)
        freed = server.store.free([e.group_id for e in buffer.entries], version)
        server.refill()
        return {"version": version, "freed_groups": freed}

    @app.get("/v1/trajectories", response_model=TrajectoryPage)
    async def trajectories(
        server: ServerDep,
        state: TrajState | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict:
        store = server.store
        with store.lock:
            rows = [(t, store.groups[t.group_id]) for t in store.trajs.values() if state is None or t.state is state]
        return {"counts": store.counts(), "total": len(rows),
                "trajectories": [summary(t, g) for t, g in rows[offset: offset + limit]]}

    @app.get("/v1/trajectories/{traj_id}", response_model=TrajectoryDetail)
    async def trajectory(server: ServerDep, traj_id: str) -> dict:
        store = server.store
        with store.lock:
            t = store.trajs.get(traj_id)
            g = store.groups[t.group_id] if t is not None else None
            held_on_instance = store.book.held_on_instance(traj_id)
        if t is None:  # done for good: read back from the archive
            t, g = store.archived_trajectory(traj_id) or (None, None)
        if t is None or g is None:
            raise StaleFlowError(ErrorCode.UNKNOWN_TRAJECTORY, f"trajectory {traj_id!r} is unknown")
        return {**summary(t, g), **traj_payload(t, g, server.config.sampling), "reward": t.reward,
                "reward_reason": t.reward_reason, "finish_reason": t.finish_reason, "prompt_text": g.prompt_text,
                "held_on_instance": held_on_instance}

    return app
