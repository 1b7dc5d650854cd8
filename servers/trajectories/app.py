"""The trajectory server's REST app: ``create_app`` wires ``TrajectoryServer`` to the endpoints."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from staleflow.servers.clients import AsyncManagerClient, ServiceError
from staleflow.servers.trajectories.config import TrajectoryServerConfig
from staleflow.servers.trajectories.rewards import RewardFn, make_reward
from staleflow.servers.trajectories.service import TrajectoryServer
from staleflow.servers.trajectories.store import (
    StoreConflict,
    TrajectoryStore,
    TrajState,
)
from staleflow.servers.trajectories.wire import (
    AckRequest,
    CheckoutRequest,
    CompletedRequest,
    ReturnRequest,
    summary,
    traj_payload,
)
from staleflow.tasks import SkippedRows

log = logging.getLogger(__name__)


def create_app(config: TrajectoryServerConfig, reward: RewardFn | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = TrajectoryStore.open(config.database_url())
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

    app = FastAPI(title="StaleFlow trajectory server", version="1", lifespan=lifespan)

    @app.exception_handler(StoreConflict)
    async def _conflict(_: Request, exc: StoreConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(ServiceError)
    async def _upstream(_: Request, exc: ServiceError) -> JSONResponse:
        # the manager's refusal of what the client asked (e.g. an unknown buffer) is the client's 4xx
        status = exc.status if 400 <= exc.status < 500 else 502
        return JSONResponse({"detail": f"staleness manager: {exc.detail}"}, status_code=status)

    @app.exception_handler(httpx.TransportError)
    async def _unreachable(_: Request, exc: httpx.TransportError) -> JSONResponse:
        return JSONResponse({"detail": f"staleness manager unreachable: {exc.__class__.__name__}"}, status_code=503)

    def ts(request: Request) -> TrajectoryServer:
        return request.app.state.ts

    @app.get("/v1/health")
    async def health(request: Request) -> dict:
        server = ts(request)
        skipped = getattr(server.prompts, "skipped", SkippedRows())
        return {"status": "ok", "counts": server.store.counts(),
                "skipped_prompts": {"count": skipped.count + server.too_long.count,
                                    "reasons": {**skipped.reasons, **server.too_long.reasons}}}

    @app.get("/v1/pending")
    async def pending(request: Request) -> dict:
        """Trajectories waiting to be routed, for the coordinator (V_traj null: initial)."""
        return {"trajectories": [summary(t, g) for t, g in ts(request).store.pending()]}

    @app.get("/v1/routed")
    async def routed(request: Request, instance_id: str | None = None) -> dict:
        return {"trajectories": [summary(t, g) for t, g in ts(request).store.routed(instance_id)]}

    @app.post("/v1/checkout")
    async def checkout(request: Request, body: CheckoutRequest) -> dict:
        return await ts(request).checkout(body)

    @app.post("/v1/return")
    async def give_back(request: Request, body: ReturnRequest) -> dict:
        outcome = ts(request).store.returned([p.model_dump() for p in body.partials], body.instance_id)
        return {"outcome": outcome}

    @app.post("/v1/completed")
    async def completed(request: Request, body: CompletedRequest) -> dict:
        return {"accepted": await ts(request).completed(body)}

    @app.post("/v1/instances/{instance_id}/release")
    async def release(request: Request, instance_id: str) -> dict:
        """The coordinator declared the instance failed: its trajectories become routable again."""
        return {"released": ts(request).store.release_instance(instance_id)}

    @app.get("/v1/cancellations")
    async def cancellations(request: Request) -> dict:
        return {"trajectories": [{"traj_id": t.traj_id, "instance_id": t.instance_id}
                                 for t in ts(request).store.cancellations()]}

    @app.post("/v1/cancellations/ack")
    async def cancellations_ack(request: Request, body: AckRequest) -> dict:
        ts(request).store.cancelled(body.traj_ids)
        return {"acknowledged": len(body.traj_ids)}

    @app.get("/v1/batches/{version}")
    async def batch(request: Request, version: int) -> dict:
        if version < 0:
            return JSONResponse({"detail": "version must be >= 0"}, status_code=422)
        return await ts(request).batch(version)

    @app.delete("/v1/batches/{version}")
    async def free_batch(request: Request, version: int) -> dict:
        server = ts(request)
        buffer = await server.manager.buffer(version)
        freed = server.store.free([e["group_id"] for e in buffer.get("entries", [])])
        server.refill()
        return {"version": version, "freed_groups": freed}

    @app.get("/v1/trajectories")
    async def trajectories(
        request: Request,
        state: TrajState | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict:
        store = ts(request).store
        with store.lock:
            rows = [(t, store.groups[t.group_id]) for t in store.trajs.values() if state is None or t.state is state]
        return {"counts": store.counts(), "total": len(rows),
                "trajectories": [summary(t, g) for t, g in rows[offset: offset + limit]]}

    @app.get("/v1/trajectories/{traj_id}")
    async def trajectory(request: Request, traj_id: str) -> dict:
        store = ts(request).store
        t = store.trajs.get(traj_id)
        if t is None:
            return JSONResponse({"detail": f"trajectory {traj_id!r} is unknown"}, status_code=404)
        g = store.groups[t.group_id]
        return {**summary(t, g), **traj_payload(t, g, ts(request).config.sampling), "reward": t.reward,
                "reward_reason": t.reward_reason, "finish_reason": t.finish_reason, "prompt_text": g.prompt_text}

    return app
