"""The instance server's REST app: ``create_app`` wires ``InstanceServer`` to the endpoints."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Response
from fastapi.responses import JSONResponse

from staleflow import metrics as m
from staleflow.api.instance import AckIn, AdvanceIn, AnyCommand, InstanceRoutes
from staleflow.config import InstanceConfig
from staleflow.engines.base import RolloutEngine
from staleflow.servers.http import Owned, handles, service_app
from staleflow.servers.instance.service import InstanceServer

log = logging.getLogger(__name__)


def instance_metrics(server: InstanceServer, snapshot: dict[str, Any] | None, stats: dict[str, Any] | None) -> list:
    """Prometheus view of one instance from its last snapshot and engine accounting."""
    iid = server.instance_id
    families = [
        m.INSTANCE_COMMANDS.family([([iid, kind], n) for kind, n in sorted(server.commands_applied.items())]),
        m.INSTANCE_COMPLETED.value(server.outbox.next_seq - 1, iid),
    ]
    if snapshot is not None:
        families += [
            m.INSTANCE_TRAJECTORIES.family([([iid, state], len(snapshot[key])) for state, key in
                                            (("running", "run_trajs"), ("waiting", "wait_trajs"),
                                             ("complete", "complete_trajs"))]),
            m.INSTANCE_VERSION.value(snapshot["inst_version"], iid),
            m.INSTANCE_KV_CACHE.value(snapshot["kv_cache"], iid),
            m.INSTANCE_LOADING.value(int(snapshot["loading_weights"]), iid),
        ]
    if stats is not None:
        source = str(stats.get("source", "engine"))
        families += [
            m.INSTANCE_ENGINE_SECONDS.family([([iid, part, source], seconds) for part, seconds in
                                              sorted(stats.get("breakdown_seconds", {}).items())]),
            m.INSTANCE_ROLLOUT_SECONDS.value(stats.get("rollout_seconds", 0.0), iid, source),
            m.INSTANCE_GENERATED_TOKENS.value(stats.get("tokens_generated", 0), iid),
        ]
    families.append(m.INSTANCE_CHECKPOINTED_TOKENS.value(server.progress.tokens, iid))
    return families


def create_app(config: InstanceConfig, engine: RolloutEngine | None = None) -> FastAPI:
    """The FastAPI app of one rollout instance; its lifespan starts and stops the engine.

    ``engine`` overrides the one ``config`` describes (for embedding an already-built engine).
    """

    server = InstanceServer(config, engine)  # built now so a bad engine config fails here, not at startup

    async def started() -> InstanceServer:
        await server.start()
        return server

    async def stopped(_: InstanceServer) -> None:
        await server.stop()

    app = service_app(f"StaleFlow rollout instance {config.instance_id}", Owned("instance", started, stopped))
    app.state.instance = server
    scraped: dict[str, Any] = {}

    async def read_engine() -> None:
        scraped["snapshot"] = await server.snapshot()
        scraped["stats"] = await server.engine.stats()

    m.mount_metrics(app, "instance", lambda: instance_metrics(server, scraped.get("snapshot"), scraped.get("stats")),
                    refresh=read_engine)

    @handles(app, InstanceRoutes.command)
    async def commands(command: Annotated[AnyCommand, Body(discriminator="kind")], response: Response) -> Any:
        status, body, replayed = await server.apply(command)
        headers = {"Idempotent-Replay": "true"} if replayed else None
        if status != 200:  # a refusal, recorded for replay like a result
            return JSONResponse(body, status_code=status, headers=headers)
        response.headers.update(headers or {})
        return body

    @handles(app, InstanceRoutes.snapshot)
    async def snapshot() -> dict[str, Any]:
        return await server.snapshot()

    @handles(app, InstanceRoutes.health)
    async def health() -> dict[str, Any]:
        return server.health()

    @handles(app, InstanceRoutes.stats)
    async def stats() -> dict[str, Any]:
        """Where the engine's time went (paper Table 3), as the engine accounts for it: parts in
        ``breakdown_seconds`` that add up to ``rollout_seconds``, labelled by ``source``."""
        accounted = await server.engine.stats()
        if accounted is None:
            return {"instance_id": server.instance_id, "engine": config.engine, "available": False}
        return {"instance_id": server.instance_id, "engine": config.engine, **accounted}

    @handles(app, InstanceRoutes.progress)
    async def progress() -> dict[str, Any]:
        """What each trajectory on the engine holds now, against its last progress checkpoint."""
        return await server.held_progress()

    @handles(app, InstanceRoutes.advance)
    async def advance(body: AdvanceIn) -> dict[str, Any]:
        return await server.advance(body)

    _add_feed_routes(app, server)
    return app


def _add_feed_routes(app: FastAPI, server: InstanceServer) -> None:
    """The completed-trajectory feed: reading it, and acknowledging what was read."""

    @handles(app, InstanceRoutes.completed)
    async def completed(
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 256,
        wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0,
    ) -> dict[str, Any]:
        """The items after ``after``; reading changes nothing (acknowledging is ``POST /v1/completed/ack``)."""
        outbox = server.outbox
        if wait_s > 0:
            await outbox.wait_after(after, wait_s)
        items = outbox.after(after, limit)
        outbox.handed_out(items)
        return {
            "items": items,
            "next_after": items[-1].seq if items else after,
            "last_seq": outbox.next_seq - 1,
            "oldest_seq": outbox.oldest_seq,
            "dropped": outbox.dropped,
        }

    @handles(app, InstanceRoutes.ack)
    async def acknowledge(body: AckIn) -> dict[str, Any]:
        """The consumer holds these items: they leave the outbox. Only items it was handed count."""
        acknowledged, ignored = server.outbox.ack(body.seqs)
        return {"acknowledged": acknowledged, "ignored": ignored}
