"""The rollout instance server: one engine behind the command / snapshot / completed-feed API.

Endpoints (all JSON; errors are ``{"error": {"code", "message"}}`` with a 4xx status):

* ``POST /v1/commands`` -- one Route / Interrupt / Abort / Pull command ``{command_id, kind, ...}``.
  Commands are applied one at a time in arrival order; each applied command gets the next sequence
  number. A retry with the same ``command_id`` and the same body gets the stored response again
  (header ``Idempotent-Replay: true``) without re-applying it; the same ``command_id`` with a
  different body is refused with 409.
* ``GET /v1/snapshot`` -- the five snapshot fields of paper §5.2 plus ``instance_id``, ``seq`` (the
  last applied command) and timestamps. Taken under the command lock, so it reflects exactly the
  commands up to ``seq``.
* ``GET /v1/completed?after=SEQ&limit=N&wait_s=S`` -- the completed-trajectory feed. Items carry
  increasing ``seq`` numbers; asking for ``after=SEQ`` also acknowledges everything up to ``SEQ``,
  which is then released (the feed has one consumer, the trajectory server). ``wait_s`` long-polls.
* Optional push: with ``completion_callback_url`` set, batches ``{"instance_id", "items"}`` are
  POSTed there in order, retried with capped exponential backoff on connection errors and 5xx
  (at-least-once: receivers deduplicate on ``(instance_id, seq)``); a 4xx answer drops the batch.
  A delivered batch is acknowledged like a poll.
* ``GET /v1/health``.
* ``POST /v1/sim/advance`` -- sim engine on the virtual clock only: ``{"to": t}``, ``{"by": dt}``
  or ``{"until_idle": true}``; returns after the finished trajectories reached the feed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import base64
import binascii
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Any, Literal

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from staleflow.config import CostConfig
from staleflow.servers.clients import async_http_client
from staleflow.engines.base import (
    CompletedTrajectory,
    EngineSnapshot,
    EngineError,
    RolloutEngine,
    SamplingParams,
    Segment,
    SimWeights,
    Trajectory,
    TrajectoryRequest,
    WeightsBlob,
    WeightsFromParams,
    WeightsPath,
    WeightsRef,
)
from staleflow.engines.sim import Clock, SimEngine, SimParams
from staleflow.workload import PRESETS, preset

log = logging.getLogger(__name__)

_ID = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"

# ---------------------------------------------------------------------------- configuration


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimConfig(CostConfig):
    """Parameters of the simulated engine (see ``staleflow.engines.sim``): its cost-model
    coefficients (inherited, flat: k1..k5, kv_budget) and the rest below."""
    workload: str = "paper-20k"
    workload_seed: int = 0
    prefill_seconds_per_token: float = Field(SimParams.prefill_seconds_per_token, ge=0)
    pull_bandwidth_bytes_per_s: float = Field(SimParams.pull_bandwidth_bytes_per_s, gt=0)
    pull_latency_s: float = Field(SimParams.pull_latency_s, ge=0)
    model_bytes: int = Field(SimParams.model_bytes, ge=0)
    max_running: int = Field(SimParams.max_running, ge=1)
    noise: float = Field(0.0, ge=0)
    noise_block_steps: int = Field(SimParams.noise_block_steps, ge=1)
    seed: int = 0
    initial_version: int = Field(0, ge=0)
    clock: Clock = Clock.VIRTUAL
    speed: float = Field(1.0, gt=0)

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, value: str) -> str:
        if value not in PRESETS:
            raise ValueError(f"unknown workload preset {value!r}; choose one of {sorted(PRESETS)}")
        return value

    def params(self) -> SimParams:
        cost = self.cost_model()
        rest = self.model_dump(exclude={"k1", "k2", "k3", "k4", "k5", "kv_budget", "workload", "workload_seed",
                                        "clock", "speed"})
        return SimParams(cost=cost, workload=preset(self.workload, self.workload_seed), **rest)


class VllmConfig(_Strict):
    """Parameters of the vLLM engine (see ``staleflow.engines.vllm_engine``)."""

    model: str = Field(min_length=1, description="local model directory (config, safetensors, tokenizer)")
    dtype: str = "bfloat16"
    max_model_len: int = Field(4096, ge=1)
    seed: int = 0
    enforce_eager: bool = True
    kv_cache_gib: int | None = Field(None, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU builds")
    max_num_seqs: int | None = Field(None, ge=1)
    initial_version: int = Field(0, ge=0)
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra AsyncEngineArgs")


class InstanceConfig(_Strict):
    """One rollout instance: its id, its engine and where it listens."""

    instance_id: str = Field(pattern=_ID)
    engine: Literal["sim", "vllm"] = "sim"
    sim: SimConfig = Field(default_factory=SimConfig)
    vllm: VllmConfig | None = None
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    completion_callback_url: str | None = Field(None, pattern=r"^https?://")
    callback_batch: int = Field(64, ge=1)
    outbox_limit: int = Field(100_000, ge=1, description="unacknowledged completions kept before the oldest drop")
    idempotency_window: int = Field(10_000, ge=1, description="command ids remembered for retries")

    @model_validator(mode="after")
    def _engine_section(self) -> InstanceConfig:
        if self.engine == "vllm" and self.vllm is None:
            raise ValueError("vllm: this section is required when engine is 'vllm' (at least vllm.model)")
        return self


def create_engine(config: InstanceConfig) -> RolloutEngine:
    if config.engine == "sim":
        sim = config.sim
        return SimEngine(sim.params(), instance_id=config.instance_id, clock=sim.clock, speed=sim.speed)
    from staleflow.engines.vllm_engine import VllmEngine, VllmEngineParams

    assert config.vllm is not None
    params = VllmEngineParams(**config.vllm.model_dump())
    return VllmEngine(params)


# ---------------------------------------------------------------------------- wire models


class SamplingIn(_Strict):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return value


class SegmentIn(_Strict):
    version: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=1)


TokenId = Annotated[int, Field(ge=0)]


class TrajectoryIn(_Strict):
    """A trajectory on the wire, fresh or partial. Partials from Interrupt can be sent back as is."""

    traj_id: str = Field(pattern=_ID)
    group_id: str = Field(min_length=1)
    prompt_ids: list[TokenId] = Field(min_length=1)
    v_traj: int = Field(ge=0, description="assigned by the coordinator before routing; never null")
    sampling: SamplingIn
    tokens: list[TokenId] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    segments: list[SegmentIn] = Field(default_factory=list)

    def to_request(self) -> TrajectoryRequest:
        return TrajectoryRequest(
            **self.model_dump(exclude={"sampling", "segments"}),
            sampling=SamplingParams(**self.sampling.model_dump()),
            segments=[Segment(**s.model_dump()) for s in self.segments],
        )


class SimWeightsIn(_Strict):
    source: Literal["sim"] = "sim"
    size_bytes: int | None = Field(None, ge=0)


class PathWeightsIn(_Strict):
    source: Literal["path"]
    path: str = Field(min_length=1)


class BytesWeightsIn(_Strict):
    source: Literal["bytes"]
    data_b64: str = Field(min_length=1, description="base64 of safetensors.torch.save(state_dict)")


class ParamsWeightsIn(_Strict):
    source: Literal["params"]
    url: str = Field(pattern=r"^https?://", max_length=2048, description="the parameter server")
    transport: Literal["auto", "http", "shm", "nixl"] = "auto"


WeightsIn = Annotated[SimWeightsIn | PathWeightsIn | BytesWeightsIn | ParamsWeightsIn, Field(discriminator="source")]


class _CommandBase(_Strict):
    command_id: str = Field(pattern=_ID)


class RouteCommand(_CommandBase):
    kind: Literal["route"]
    trajectories: list[TrajectoryIn] = Field(min_length=1)


class InterruptCommand(_CommandBase):
    kind: Literal["interrupt"]
    traj_ids: list[str] = Field(min_length=1)


class AbortCommand(_CommandBase):
    kind: Literal["abort"]
    traj_ids: list[str] = Field(min_length=1)


class PullCommand(_CommandBase):
    kind: Literal["pull"]
    version: int = Field(ge=0)
    weights: WeightsIn | None = Field(None, description="default for the sim engine: the configured model size")

    def weights_ref(self) -> WeightsRef:
        w = self.weights
        if w is None or isinstance(w, SimWeightsIn):
            return SimWeights(self.version, None if w is None else w.size_bytes)
        if isinstance(w, PathWeightsIn):
            return WeightsPath(self.version, w.path)
        if isinstance(w, ParamsWeightsIn):
            return WeightsFromParams(self.version, w.url, w.transport)
        try:
            return WeightsBlob(self.version, base64.b64decode(w.data_b64, validate=True))
        except binascii.Error as exc:
            raise EngineError("invalid_weights", f"weights.data_b64 is not base64: {exc}") from None


AnyCommand = RouteCommand | InterruptCommand | AbortCommand | PullCommand
Command = Annotated[AnyCommand, Field(discriminator="kind")]


class CommandEnvelope(BaseModel):
    command: Command


MAX_SIM_SECONDS = 1e9  # ~31 simulated years: beyond this, float time steps lose their meaning


class AdvanceIn(_Strict):
    to: float | None = Field(None, ge=0, le=MAX_SIM_SECONDS)
    by: float | None = Field(None, ge=0, le=MAX_SIM_SECONDS)
    until_idle: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> AdvanceIn:
        given = (self.to is not None) + (self.by is not None) + self.until_idle
        if given != 1:
            raise ValueError("give exactly one of 'to', 'by' or 'until_idle'")
        for name in ("to", "by"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite")
        return self


def trajectory_json(t: Trajectory) -> dict[str, Any]:
    data: dict[str, Any] = {
        "traj_id": t.traj_id,
        "group_id": t.group_id,
        "prompt_ids": list(t.prompt_ids),
        "v_traj": t.v_traj,
        "sampling": {**asdict(t.sampling), "stop_token_ids": list(t.sampling.stop_token_ids)},
        "tokens": list(t.tokens),
        "logprobs": list(t.logprobs),
        "segments": [{"version": s.version, "start": s.start, "end": s.end} for s in t.segments],
    }
    if isinstance(t, CompletedTrajectory):
        data["finish_reason"] = t.finish_reason.value
    return data


# ---------------------------------------------------------------------------- errors

_STATUS = {
    "duplicate_trajectory": 409,
    "version_too_new": 409,
    "version_regression": 409,
    "command_id_reused": 409,
    "wrong_clock": 409,
    "time_backwards": 409,
    "not_sim": 404,
}


def error_response(code: str, message: str, status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}}, status_code=status or _STATUS.get(code, 422))


def _describe(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "command"))
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts)


def _plain_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
        for e in errors
    ]


# ---------------------------------------------------------------------------- state


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
                status, body = _STATUS.get(exc.code, 422), {"error": {"code": exc.code, "message": exc.message}}
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


# ---------------------------------------------------------------------------- app


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
        return error_response("invalid_request", _describe(errors), 422, details=_plain_errors(errors))

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
            return error_response("invalid_command", _describe(errors), 422, details=_plain_errors(errors))
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


__all__ = [
    "AbortCommand",
    "InstanceConfig",
    "InstanceServer",
    "InterruptCommand",
    "PullCommand",
    "RouteCommand",
    "SimConfig",
    "TrajectoryIn",
    "VllmConfig",
    "create_app",
    "create_engine",
    "trajectory_json",
]
