"""The rollout instance server's contract: its wire models (commands, weights sources, the sim
clock's advance, the completed feed; the trajectories they carry are ``staleflow.api.trajectory``'s)
and its client (sync and async)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from staleflow.api.base import AsyncClient, Client, Route
from staleflow.api.trajectory import Completion, WireTrajectory
from staleflow.config.instance import ID_PATTERN
from staleflow.strict import StrictModel


class SimWeightsIn(StrictModel):
    source: Literal["sim"] = "sim"
    size_bytes: int | None = Field(default=None, ge=0)


class PathWeightsIn(StrictModel):
    source: Literal["path"]
    path: str = Field(min_length=1)


class BytesWeightsIn(StrictModel):
    source: Literal["bytes"]
    data_b64: str = Field(min_length=1, description="base64 of safetensors.torch.save(state_dict)")


class ParamsWeightsIn(StrictModel):
    source: Literal["params"] = "params"
    url: str = Field(pattern=r"^https?://", max_length=2048, description="the parameter server")
    transport: Literal["auto", "http", "shm", "nixl"] = "auto"


WeightsIn = Annotated[SimWeightsIn | PathWeightsIn | BytesWeightsIn | ParamsWeightsIn, Field(discriminator="source")]


class _CommandBase(StrictModel):
    command_id: str = Field(pattern=ID_PATTERN)


class RouteCommand(_CommandBase):
    kind: Literal["route"] = "route"
    trajectories: list[WireTrajectory] = Field(min_length=1)


class InterruptCommand(_CommandBase):
    kind: Literal["interrupt"] = "interrupt"
    traj_ids: list[str] = Field(min_length=1)


class AbortCommand(_CommandBase):
    kind: Literal["abort"] = "abort"
    traj_ids: list[str] = Field(min_length=1)


class PullCommand(_CommandBase):
    kind: Literal["pull"] = "pull"
    version: int = Field(ge=0)
    weights: WeightsIn | None = Field(default=None, description="default for the sim engine: the configured model size")
    keep_running: bool = Field(default=False, description="an in-flight weight update: the trajectories on the instance are "
                                                  "not interrupted, they keep their KV cache and continue on the new "
                                                  "weights (else every one is interrupted and handed back)")


AnyCommand = RouteCommand | InterruptCommand | AbortCommand | PullCommand
Command = Annotated[AnyCommand, Field(discriminator="kind")]


MAX_SIM_SECONDS = 1e9  # ~31 simulated years: beyond this, float time steps lose their meaning


class AdvanceIn(StrictModel):
    to: float | None = Field(default=None, ge=0, le=MAX_SIM_SECONDS)
    by: float | None = Field(default=None, ge=0, le=MAX_SIM_SECONDS)
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


# -- answers


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Applied(_Answer):
    command_id: str
    seq: int = Field(description="the command's place in this instance's order of applied commands")


class RouteApplied(_Applied):
    kind: Literal["route"]
    routed: list[str]


class InterruptApplied(_Applied):
    kind: Literal["interrupt"]
    partials: list[WireTrajectory]
    not_found: list[str]


class AbortApplied(_Applied):
    kind: Literal["abort"]
    aborted: list[str]
    not_found: list[str]


class PullApplied(_Applied):
    kind: Literal["pull"]
    version: int
    partials: list[WireTrajectory] = Field(description="everything in flight, interrupted by the weight load")
    kept: list[str] = Field(default_factory=list, description="keep_running: the trajectories that went on through "
                                                              "the load (on the instance, or completed since)")


CommandApplied = Annotated[RouteApplied | InterruptApplied | AbortApplied | PullApplied, Field(discriminator="kind")]


class SnapshotOut(_Answer):
    instance_id: str
    boot_id: str
    seq: int
    timestamp: float
    engine_time: float | None
    kv_cache: int | float
    run_trajs: list[str]
    wait_trajs: list[str]
    complete_trajs: list[str]
    inst_version: int
    loading_weights: bool
    decode_steps: int | None = Field(default=None, description="decode steps since the engine started (null: not reported)")
    decode_seconds: float | None = Field(default=None, description="the seconds those steps took, prefill excluded")
    kv_usage: float | None = Field(default=None, ge=0, description="the share of the engine's KV memory in use (vLLM: "
                                   "the scheduler's block usage; null: not reported)")
    generated: dict[str, int] | None = Field(default=None, description="traj_id -> response tokens each running or waiting "
                                                               "trajectory holds now (null: not reported)")


class CompletedFeed(_Answer):
    items: list[Completion]
    next_after: int
    last_seq: int
    oldest_seq: int | None
    dropped: int


class AckIn(StrictModel):
    seqs: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=10_000,
                                                    description="the seqs of completed items the consumer holds")


class AckOut(_Answer):
    acknowledged: list[int]
    ignored: list[int] = Field(description="unknown, already acknowledged, or never handed out: nothing changed")


class InstanceHealth(_Answer):
    status: str
    instance_id: str
    engine: str
    seq: int
    outbox: dict[str, int]
    callback: dict[str, Any]


class HeldProgress(_Answer):
    instance_id: str
    available: bool = Field(description="whether the engine exposes the tokens it generated so far")
    held: dict[str, int] = Field(description="traj_id -> response tokens the trajectory holds on the engine now")
    checkpointed: dict[str, int] = Field(description="traj_id -> response tokens its last checkpoint holds")
    batches: int = Field(description="checkpoint batches sent")
    checkpoints: int = Field(description="trajectory checkpoints sent")
    tokens: int = Field(description="tokens sent in checkpoints")
    seconds: float = Field(description="time spent taking and sending checkpoints")
    since_last_round_s: float | None = Field(description="since the last look at the engine for checkpoints due")


class EngineStats(BaseModel):
    """Where the engine's time went, for engines that account for it (their own fields follow)."""

    model_config = ConfigDict(extra="allow")
    instance_id: str
    engine: str
    available: bool


class Advanced(_Answer):
    now: float
    completed_seq: int


class InstanceRoutes:
    """The rollout instance's REST API."""

    command: Route[RouteApplied | InterruptApplied | AbortApplied | PullApplied] = Route(
        "POST", "/v1/commands", CommandApplied, body="command")
    snapshot = Route("GET", "/v1/snapshot", SnapshotOut)
    completed = Route("GET", "/v1/completed", CompletedFeed, query=("after", "limit", "wait_s"))
    ack = Route("POST", "/v1/completed/ack", AckOut, body=AckIn)
    health = Route("GET", "/v1/health", InstanceHealth)
    stats = Route("GET", "/v1/stats", EngineStats)
    progress = Route("GET", "/v1/progress", HeldProgress)
    advance = Route("POST", "/v1/sim/advance", Advanced, body=AdvanceIn)


class InstanceClient(InstanceRoutes, Client):
    """A rollout instance's client."""


class AsyncInstanceClient(InstanceRoutes, AsyncClient):
    """A rollout instance's client, for services running on an event loop (the coordinator)."""
