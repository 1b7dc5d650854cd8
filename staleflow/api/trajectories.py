"""The trajectory server's contract: its wire models (the trajectories they carry are
``staleflow.api.trajectory``'s) and its client (sync and async)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from staleflow.api.base import AsyncClient, Client, Route
from staleflow.api.trajectory import FinishedPart, GeneratedPart, ProgressPart, TrainingTrajectory, WireTrajectory


class Assignment(BaseModel):
    traj_id: str
    v_traj: int = Field(ge=0)


class CheckoutRequest(BaseModel):
    instance_id: str = Field(min_length=1, max_length=200)
    assignments: list[Assignment] = Field(min_length=1, max_length=100_000)


class ReturnRequest(BaseModel):
    instance_id: str | None = Field(default=None, min_length=1, max_length=200)
    partials: list[GeneratedPart] = Field(max_length=100_000)


class CompletedIn(BaseModel):
    """A completed trajectory as the instances deliver it (``staleflow.api.trajectory.Completion``)."""

    seq: int | None = None
    instance_id: str | None = Field(default=None, min_length=1, max_length=200)
    trajectory: FinishedPart


class CompletedRequest(BaseModel):
    instance_id: str = Field(min_length=1, max_length=200)
    items: list[CompletedIn] = Field(max_length=100_000)


class ProgressRequest(BaseModel):
    instance_id: str = Field(min_length=1, max_length=200)
    trajectories: list[ProgressPart] = Field(max_length=100_000)
    held: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=100_000,
        description="traj_id -> response tokens each trajectory on the instance holds now, checkpointed or not: "
                    "what it holds beyond its checkpoint is counted as regenerated if the instance fails")


class ProgressOut(BaseModel):
    stored: dict[str, int] = Field(description="traj_id -> response tokens the trajectory server now holds")
    ignored: list[str] = Field(description="not routed to this instance, not running, or not continuing what is "
                                           "held: nothing changed")


class ReleaseRequest(BaseModel):
    generated: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=100_000,
        description="traj_id -> response tokens each trajectory held on the failed instance at the coordinator's "
                    "last snapshot of it: what it held beyond its checkpoint is counted as regenerated")


class AckRequest(BaseModel):
    traj_ids: list[str] = Field(max_length=100_000)


# -- answers


class Returned(BaseModel):
    outcome: dict[str, str] = Field(description="traj_id -> pending, aborted, unknown or ignored (its state)")


class Accepted(BaseModel):
    accepted: int


class Released(BaseModel):
    released: int


class Cancellation(BaseModel):
    traj_id: str
    instance_id: str | None


class CancellationsOut(BaseModel):
    trajectories: list[Cancellation]


class Acknowledged(BaseModel):
    acknowledged: int


class Freed(BaseModel):
    version: int
    freed_groups: int


class TrajectorySummary(BaseModel):
    traj_id: str
    group_id: str
    state: str
    v_traj: int | None
    length: int = Field(description="prompt plus generated tokens")
    generated: int
    instance_id: str | None
    seq: int
    prompt_key: str | None = Field(default=None, description="the same prompt sampled again has the same key "
                                                             "(what the length predictor learns per prompt)")


class TrajectoriesOut(BaseModel):
    trajectories: list[TrajectorySummary]


class CheckedOut(BaseModel):
    trajectories: list[WireTrajectory]
    refused: list[dict[str, str]] = Field(description="{traj_id, reason} of assignments not granted")


class BatchOut(BaseModel):
    version: int
    groups: list[str]
    trajectories: list[TrainingTrajectory]


class TrajectoryDetail(TrajectorySummary, WireTrajectory):
    """A trajectory in any state (``v_traj`` null: pending, never routed)."""

    v_traj: int | None  # pyright: ignore[reportIncompatibleVariableOverride]  (pending: its group has none yet)
    reward: float | None
    reward_reason: str | None
    finish_reason: str | None
    prompt_text: str
    held_on_instance: int | None = Field(default=None, description="response tokens its instance last said it holds "
                                                           "(routed trajectories): a failure now regenerates those "
                                                           "beyond what is stored")


class TrajectoryPage(BaseModel):
    counts: dict[str, int]
    total: int
    trajectories: list[TrajectorySummary]


class SkippedPrompts(BaseModel):
    count: int
    reasons: dict[str, int]


class ProgressCounts(BaseModel):
    checkpointed_tokens: int = Field(description="response tokens appended from progress checkpoints")
    failed_over: int = Field(description="running trajectories handed back from a failed instance")
    resumed_tokens: int = Field(description="response tokens those trajectories kept (their last checkpoints)")
    regenerated_trajectories: int = Field(description="trajectories handed back holding less than their instance "
                                                      "last said it had generated (kept across restarts)")
    regenerated_tokens: int = Field(description="the tokens they lost, generated again (kept across restarts)")


class TrajectoryServerHealth(BaseModel):
    status: str = Field(description="ok, or degraded: up, but a dependency it needs is not (see dependencies)")
    counts: dict[str, int]
    dependencies: dict[str, str] = Field(default_factory=dict, description="each dependency that is down, and why")
    skipped_prompts: SkippedPrompts
    progress: ProgressCounts = Field(description="since this trajectory server started")
    staleness_violations: int = Field(default=0, description="trajectories trained with a token more than eta versions "
                                                     "older than their buffer (staleness from the oldest segment "
                                                     "version), since this trajectory server started: must be 0")


class LengthSkewOut(BaseModel):
    """``staleflow.length_skew.LengthSkew.to_json``: per-bucket counts keyed by bucket label."""

    model_config = {"extra": "allow"}
    buckets: str
    generated: dict[str, int]
    trained: dict[str, int]
    aborted: dict[str, int]
    filtered: dict[str, int]
    dropped: dict[str, int]
    in_flight: dict[str, int]
    regenerated_tokens: dict[str, int]
    staleness_mean: dict[str, float]
    admission: dict[str, int | float]
    ks_distance: float | None
    wasserstein_tokens: float | None
    trained_over_generated_mean: float | None
    per_step: list[dict[str, Any]]


class FinishedLength(BaseModel):
    id: int = Field(description="the feed's position: ids only grow, never reused")
    traj_id: str
    group_id: str
    prompt_key: str
    length: int = Field(description="response tokens")


class FinishedLengthsOut(BaseModel):
    """A page of the finished-lengths feed: completed trajectories' lengths, oldest first."""

    epoch: str = Field(description="the feed's identity, made once per database: a cursor from another epoch "
                                   "means nothing here (follow from 0)")
    lengths: list[FinishedLength]
    next: int = Field(description="the cursor to ask after next (the last id of the page, or the cursor asked with)")
    skipped: int = Field(description="lengths after the cursor already pruned (only the newest are kept)")


class TrajectoryRoutes:
    """The trajectory server's REST API."""

    health = Route("GET", "/v1/health", TrajectoryServerHealth)
    length_skew = Route("GET", "/v1/length-skew", LengthSkewOut, query=("after_step",))
    pending = Route("GET", "/v1/pending", TrajectoriesOut)
    finished_lengths = Route("GET", "/v1/finished-lengths", FinishedLengthsOut, query=("after", "limit"))
    routed = Route("GET", "/v1/routed", TrajectoriesOut, query=("instance_id",))
    checkout = Route("POST", "/v1/checkout", CheckedOut, body=CheckoutRequest)
    give_back = Route("POST", "/v1/return", Returned, body=ReturnRequest)
    completed = Route("POST", "/v1/completed", Accepted, body=CompletedRequest)
    progress = Route("POST", "/v1/progress", ProgressOut, body=ProgressRequest)
    release = Route("POST", "/v1/instances/{instance_id}/release", Released, body=ReleaseRequest)
    cancellations = Route("GET", "/v1/cancellations", CancellationsOut)
    cancellations_ack = Route("POST", "/v1/cancellations/ack", Acknowledged, body=AckRequest)
    batch = Route("GET", "/v1/batches/{version}", BatchOut)
    free_batch = Route("DELETE", "/v1/batches/{version}", Freed)
    trajectories = Route("GET", "/v1/trajectories", TrajectoryPage, query=("state", "limit", "offset"))
    trajectory = Route("GET", "/v1/trajectories/{traj_id}", TrajectoryDetail)


class TrajectoryClient(TrajectoryRoutes, Client):
    """The trajectory server's client."""


class AsyncTrajectoryClient(TrajectoryRoutes, AsyncClient):
    """The trajectory server's client, for services running on an event loop (the coordinator)."""
