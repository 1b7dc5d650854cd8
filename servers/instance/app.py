"""The instance server's REST app: ``create_app`` wires ``InstanceServer`` to the endpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from staleflow.engines.base import (
    EngineError,
    RolloutEngine,
)
from staleflow.servers.instance.config import InstanceConfig
from staleflow.servers.instance.state import InstanceServer
from staleflow.servers.instance.wire import AdvanceIn, CommandEnvelope, describe_errors, error_response, plain_errors

log = logging.getLogger(__name__)


def create_app(config: InstanceConfig, engine: RolloutEngine | None = None) -> FastAPI:
    """The FastAPI app of one rollout instance; its lifespan starts and stops the engine.

    ``engine`` overrides the one ``config`` describes (for embedding an already-built engine).
    """

    server = InstanceServer(config, engine)  # built now so a bad engine config fails here, not at startup

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title=f"StaleFlow rollout instance {config.instance_id}", lifespan=lifespan)
    app.state.instance = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return error_response("invalid_request", describe_errors(errors), 422, details=plain_errors(errors))

    @app.exception_handler(EngineError)
    async def _refused(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.code, exc.message)

    @app.post("/v1/commands")
    async def commands(request: Request) -> JSONResponse:
        try:
            payload = await request.json()
        except ValueError:
            return error_response("invalid_request", "body must be a JSON object", 400)
        try:
            command = CommandEnvelope.model_validate({"command": payload}).command
        except ValidationError as exc:
            errors = list(exc.errors())
            return error_response("invalid_command", describe_errors(errors), 422, details=plain_errors(errors))
        status, body, replayed = await server.apply(command)
        headers = {"Idempotent-Replay": "true"} if replayed else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/v1/snapshot")
    async def snapshot() -> dict[str, Any]:
        return await server.snapshot()

    @app.get("/v1/completed")
    async def completed(
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 256,
        wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0,
    ) -> dict[str, Any]:
        outbox = server.outbox
        outbox.ack(after)
        if wait_s > 0:
            await outbox.wait_after(after, wait_s)
        items = outbox.after(after, limit)
        return {
            "items": items,
            "next_after": items[-1]["seq"] if items else after,
            "last_seq": outbox.next_seq - 1,
            "oldest_seq": outbox.oldest_seq,
            "dropped": outbox.dropped,
        }

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return server.health()

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        """Where the engine's time went (paper Table 3), for engines that account for it."""
        core = getattr(server.engine, "core", None)
        if core is None:
            return {"instance_id": server.instance_id, "engine": config.engine, "available": False}
        return {"instance_id": server.instance_id, "engine": config.engine, "available": True,
                **dataclasses.asdict(core.stats)}

    @app.post("/v1/sim/advance")
    async def advance(body: AdvanceIn) -> dict[str, Any]:
        return await server.advance(body)

    return app
