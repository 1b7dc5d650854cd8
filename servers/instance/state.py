"""The instance server's state: the completed-trajectory outbox and ``InstanceServer``, which applies
commands to the engine one at a time, records them for idempotent replay and feeds the outbox."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

import httpx

from staleflow.engines.base import (
    CompletedTrajectory,
    EngineError,
    EngineSnapshot,
    RolloutEngine,
)
from staleflow.engines.sim import Clock, SimEngine
from staleflow.servers.clients import async_http_client
from staleflow.servers.instance.config import InstanceConfig, create_engine
from staleflow.servers.instance.wire import (
    ERROR_STATUS,
    AbortCommand,
    AdvanceIn,
    AnyCommand,
    InterruptCommand,
    RouteCommand,
    trajectory_json,
)

log = logging.getLogger(__name__)


@dataclass
class _Recorded:
    fingerprint: str
    status: int
    body: dict[str, Any]


class Outbox:
    """Completed trajectories numbered 1, 2, ... and kept until acknowledged."""

    def __init__(self, limit: int):
        self.limit = limit
        self.next_seq = 1
        self.acked = 0
        self.dropped = 0
        self._items: deque[tuple[int, dict[str, Any]]] = deque()
        self._arrived = asyncio.Event()

    def add(self, instance_id: str, trajectory: CompletedTrajectory) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self._items.append((seq, {"seq": seq, "instance_id": instance_id, "finished_at": time.time(),
                                  "trajectory": trajectory_json(trajectory)}))
        if len(self._items) > self.limit:
            lost, _ = self._items.popleft()
            self.dropped += 1
            log.warning("outbox over its limit of %d: dropped completed trajectory seq %d unacknowledged", self.limit, lost)
        self._arrived.set()

    def ack(self, seq: int) -> None:
        self.acked = max(self.acked, min(seq, self.next_seq - 1))
        while self._items and self._items[0][0] <= self.acked:
            self._items.popleft()

    def after(self, seq: int, limit: int) -> list[dict[str, Any]]:
        out = []
        for item_seq, item in self._items:
            if item_seq > seq:
                out.append(item)
                if len(out) >= limit:
                    break
        return out

    async def wait_after(self, seq: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.next_seq - 1 <= seq:
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    @property
    def oldest_seq(self) -> int | None:
        return self._items[0][0] if self._items else None

    def __len__(self) -> int:
        return len(self._items)


class InstanceServer:
    """The state behind the HTTP API of one instance."""

    def __init__(self, config: InstanceConfig, engine: RolloutEngine | None = None):
        self.config = config
        self.instance_id = config.instance_id
        self.engine = engine or create_engine(config)
        self.seq = 0
        self.outbox = Outbox(config.outbox_limit)
        self.callback_delivered = 0
        self.boot_id = uuid.uuid4().hex  # a restarted instance is a new one: the coordinator tells them apart
        self._lock = asyncio.Lock()
        self._pulling = False
        self._recorded: OrderedDict[str, _Recorded] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.engine.start()
        self._tasks.append(asyncio.create_task(self._collect_completions(), name="completions"))
        if self.config.completion_callback_url:
            self._tasks.append(asyncio.create_task(self._push_completions(), name="callback"))

    async def stop(self) -> None:
        await self.engine.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _collect_completions(self) -> None:
        async for trajectory in self.engine.completions():
            self.outbox.add(self.instance_id, trajectory)

    async def _push_completions(self) -> None:
        url = self.config.completion_callback_url
        assert url is not None
        backoff = 0.1
        async with async_http_client("", timeout=30.0) as client:  # absolute URL; carries the token
            while True:
                await self.outbox.wait_after(self.callback_delivered, 3600.0)
                batch = self.outbox.after(self.callback_delivered, self.config.callback_batch)
                if not batch:
                    continue
                try:
                    reply = await client.post(url, json={"instance_id": self.instance_id, "items": batch})
                except httpx.HTTPError as exc:
                    log.warning("completion callback %s failed (%s); retrying in %.1fs", url, exc, backoff)
                else:
                    if reply.status_code < 500:
                        if reply.status_code >= 400:
                            log.error("completion callback %s refused seq %d-%d with %d: dropped",
                                      url, batch[0]["seq"], batch[-1]["seq"], reply.status_code)
                        self.callback_delivered = batch[-1]["seq"]
                        self.outbox.ack(self.callback_delivered)
                        backoff = 0.1
                        continue
                    log.warning("completion callback %s answered %d; retrying in %.1fs", url, reply.status_code, backoff)
                await asyncio.sleep(backoff)  # retry pacing, not synchronisation
                backoff = min(backoff * 2, 5.0)

    # ------------------------------------------------------------------ commands

    async def apply(self, command: AnyCommand) -> tuple[int, dict[str, Any], bool]:
        """Apply (or replay) a command; returns (status, body, replayed)."""
        fingerprint = hashlib.sha256(command.model_dump_json().encode()).hexdigest()
        async with self._lock:
            recorded = self._recorded.get(command.command_id)
            if recorded is not None:
                if recorded.fingerprint != fingerprint:
                    body = {"error": {"code": "command_id_reused", "message":
                                      f"command_id {command.command_id} was already used for a different command"}}
                    return 409, body, False
                return recorded.status, recorded.body, True
            try:
                result = await self._execute(command)
            except EngineError as exc:
                status, body = ERROR_STATUS.get(exc.code, 422), {"error": {"code": exc.code, "message": exc.message}}
            else:
                self.seq += 1
                status, body = 200, {"command_id": command.command_id, "kind": command.kind, "seq": self.seq, **result}
            self._recorded[command.command_id] = _Recorded(fingerprint, status, body)
            while len(self._recorded) > self.config.idempotency_window:
                self._recorded.popitem(last=False)
            return status, body, False

    async def _execute(self, command: AnyCommand) -> dict[str, Any]:
        if isinstance(command, RouteCommand):
            try:
                requests = [t.to_request() for t in command.trajectories]
            except ValueError as exc:  # cross-field checks of the trajectory dataclasses
                raise EngineError("invalid_trajectory", str(exc)) from None
            await self.engine.route(requests)
            return {"routed": [r.traj_id for r in requests]}
        if isinstance(command, InterruptCommand):
            result = await self.engine.interrupt(command.traj_ids)
            return {"partials": [trajectory_json(p) for p in result.partials], "not_found": result.not_found}
        if isinstance(command, AbortCommand):
            abort = await self.engine.abort(command.traj_ids)
            return {"aborted": abort.aborted, "not_found": abort.not_found}
        self._pulling = True
        try:
            partials = await self.engine.load_weights(command.weights_ref())
        finally:
            self._pulling = False
        return {"version": command.version, "partials": [trajectory_json(p) for p in partials]}

    async def snapshot(self) -> dict[str, Any]:
        if self._pulling:  # a weight load can take a while: answer without waiting for it
            snap = await self.engine.snapshot()
            return self._snapshot_json(replace(snap, loading_weights=True))
        async with self._lock:
            return self._snapshot_json(await self.engine.snapshot())

    def _snapshot_json(self, snap: EngineSnapshot) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "boot_id": self.boot_id,
            "seq": self.seq,
            "timestamp": time.time(),
            "engine_time": snap.time,
            "kv_cache": snap.kv_cache,
            "run_trajs": list(snap.run_trajs),
            "wait_trajs": list(snap.wait_trajs),
            "complete_trajs": list(snap.complete_trajs),
            "inst_version": snap.inst_version,
            "loading_weights": snap.loading_weights,
        }

    async def advance(self, request: AdvanceIn) -> dict[str, Any]:
        engine = self.engine
        if not isinstance(engine, SimEngine):
            raise EngineError("not_sim", "only the sim engine has a virtual clock to advance")
        async with self._lock:
            if request.until_idle:
                if engine.clock is not Clock.VIRTUAL:
                    raise EngineError("wrong_clock", "advance needs the virtual clock; this engine runs on real time")
                await engine.run_until_idle()
            elif request.to is not None:
                if request.to < engine.now:
                    raise EngineError("time_backwards", f"virtual time is already {engine.now}, cannot go to {request.to}")
                await engine.advance_to(request.to)
            else:
                await engine.advance_by(request.by or 0.0)
            await engine.drained()
            return {"now": engine.now, "completed_seq": self.outbox.next_seq - 1}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "instance_id": self.instance_id,
            "engine": self.config.engine,
            "seq": self.seq,
            "outbox": {
                "last_seq": self.outbox.next_seq - 1,
                "acked": self.outbox.acked,
                "pending": len(self.outbox),
                "dropped": self.outbox.dropped,
            },
            "callback": {"url": self.config.completion_callback_url, "delivered_seq": self.callback_delivered},
        }
