"""The coordinator's contract: its wire models and its client (sync and async)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from staleflow.api.base import Client, Route
from staleflow.api.instance import SnapshotOut
from staleflow.config.coordinator import InstanceEndpoint


class CoordinatorHealth(BaseModel):
    status: str
    cycles: int


class InstanceView(BaseModel):
    """An instance as the coordinator sees it (``Coordinator.describe``)."""

    model_config = ConfigDict(extra="forbid")
    instance_id: str
    url: str
    params_url: str | None = Field(default=None, description="where the instance pulls weights")
    status: str = Field(description="joining, live, syncing or failed")
    validated: bool
    snapshot: dict[str, Any] | None
    speculative: dict[str, int] | None = Field(description="the speculative state P: inst_version, accum_traj_num")
    estimated_throughput: float
    commands_in_flight: int
    refused: str | None = Field(default=None, description="why the coordinator does not let the instance join (null: it "
                                                  "does)")


class InstancesOut(BaseModel):
    ps_version: int
    instances: list[InstanceView]


class Removed(BaseModel):
    instance_id: str
    released: int | None = Field(description="trajectories handed back to pending; null: the trajectory server was "
                                             "unreachable, and reconciliation hands them back after its grace period")


class CommandView(BaseModel):
    command_id: str
    instance_id: str
    kind: str
    size: int
    issued_at: float
    completed_at: float | None
    outcome: str


class CommandsOut(BaseModel):
    commands: list[CommandView]


class CoordinatorStatsOut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cycles: int
    accepted_snapshots: int
    discarded_snapshots: int
    last_decision_ms: float
    mean_decision_ms: float
    routed: int
    interrupted: int
    pulls: int
    aborts: int
    failures: int
    rejoined: int
    released: int
    reconciled: int
    strays_aborted: int
    rerouted_pulls: int = Field(default=0, description="Pulls of a version nobody could serve any more, sent again for the "
                                                       "newest version that exists")
    unreachable: int
    cycle_ms_total: float
    phase_ms_total: dict[str, float] = Field(
        default_factory=dict, description="wall time of each step of the cycle (snapshots, polls, admission, issue...), "
                                          "summed over every cycle")
    decisions: int
    decision_ms_total: float
    command_count: dict[str, int]
    command_seconds: dict[str, float]
    strategy: dict[str, str]


class LearnedLengthsOut(BaseModel):
    """The coordinator's length predictor (``LengthPredictor``) and its place in the trajectory
    server's feed of finished lengths."""

    epoch: str | None = Field(description="the feed's epoch (the trajectory server's database); null: none read yet")
    cursor: int = Field(description="the id of the last finished length learned")
    observed: int = Field(description="finished lengths learned")
    skipped: int = Field(description="finished lengths the feed had pruned before they were read")
    typical_length: float = Field(description="the median final length of a new prompt's trajectory under the prior")
    tail: float | None = Field(default=None, description="adaptive redundancy: the last predicted tail (the longest "
                                                         "remainder the next buffer waits for, over a typical length)")
    withheld: int = Field(default=0, description="adaptive redundancy: admissions withheld from the last table")
    log_mean: float
    group_variance: float
    member_variance: float


class InstanceInputsOut(BaseModel):
    decode_steps: int | None = Field(description="the engine's decode-only steps at the snapshot (null: not reported)")
    decode_seconds: float | None
    speed: float = Field(description="the decode speed against the cost model they gave (1.0: as modelled)")
    kv_cache: float
    running: int


class PullDecisionOut(BaseModel):
    instance_id: str
    version: int
    kept: bool = Field(description="the Pull kept the trajectories running (else they were interrupted and routed)")
    inputs: dict[str, InstanceInputsOut] = Field(description="every planned instance, as the choice read it")


class LearningOut(BaseModel):
    """What the coordinator learned of the job as it runs, and what it decided from it."""

    lengths: LearnedLengthsOut | None = Field(description="null: routing is not length-aware, nothing is learned")
    speeds: dict[str, float] = Field(description="each instance's decode speed against the cost model")
    pull_decisions: list[PullDecisionOut] = Field(description="the newest pull: auto choices, oldest first")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrajectoryWaitOut(_Out):
    traj_id: str
    state: str = Field(description="pending, routed, completed, rewarded, cancelling or aborted")
    where: str = Field(description="where it is, in words")
    instance_id: str | None
    generated: int = Field(description="response tokens so far (the instance's count where it gave one)")
    max_tokens: int | None
    ready_in_s: float | None = Field(description="seconds until it finishes, by the cost model; null: no estimate")


class GroupWaitOut(_Out):
    group_id: str
    v_traj: int
    buffer: int = Field(description="the buffer the ledger places it in now")
    required: bool = Field(description="it holds a slot up to the buffer asked about and must be occupied itself; "
                                       "otherwise it fills a slot once occupied, if it is among the first")
    completed: int = Field(description="members completed")
    needed: int = Field(description="members it needs completed (the group size)")
    trajectories: list[TrajectoryWaitOut]
    ready_in_s: float | None
    note: str


class BufferExplanationOut(_Out):
    version: int
    train_version: int
    state: str = Field(description="waiting, ready, stuck or consumed")
    consumable: bool = Field(description="the trainer can consume it now")
    batch_size: int
    capacity: int
    occupied: int
    reserved: int
    empty: int
    needed: int = Field(description="groups still to be occupied before it is ready (in it and the buffers before it)")
    unreserved: int = Field(description="of those, slots no live group can fill: they wait for new reservations")
    consume_first: list[int] = Field(description="buffers the trainer consumes before it")
    groups: list[GroupWaitOut] = Field(description="what it waits for: required groups, then the others by "
                                                   "expected readiness")
    ready_in_s: float | None = Field(description="seconds until the cost model expects it ready; null: no estimate "
                                                 "(`estimate` says why)")
    estimate: str = Field(description="how the estimate was made, or why there is none")
    summary: str


class CoordinatorRoutes:
    """The coordinator's REST API: the instance pool and what the cycle did."""

    health = Route("GET", "/v1/health", CoordinatorHealth)
    instances = Route("GET", "/v1/instances", InstancesOut)
    register = Route("POST", "/v1/instances", InstanceView, body=InstanceEndpoint)
    upsert = Route("PUT", "/v1/instances/{instance_id}", InstanceView, body="endpoint")
    instance = Route("GET", "/v1/instances/{instance_id}", InstanceView)
    remove = Route("DELETE", "/v1/instances/{instance_id}", Removed)
    instance_snapshot = Route("GET", "/v1/instances/{instance_id}/snapshot", SnapshotOut)
    commands = Route("GET", "/v1/commands", CommandsOut, query=("limit",))
    stats = Route("GET", "/v1/coordinator", CoordinatorStatsOut)
    learning = Route("GET", "/v1/learning", LearningOut)
    explain_buffer = Route("GET", "/v1/buffers/{version}/explain", BufferExplanationOut)


class CoordinatorClient(CoordinatorRoutes, Client):
    """The coordinator's client."""

