"""``GET /v1/buffers/{version}/explain``: why a buffer is not consumable yet.

The ledger knows the buffers and their groups; only the coordinator knows the instances, what they
run and the cost model. This module gathers the views (the manager's buffers, the trajectory
server's live trajectories, the progress of the instances that hold the waiting ones) and hands
them to the pure ``staleflow.buffer_explain``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from staleflow.buffer_explain import (
    BufferExplanation,
    InstanceSeen,
    TrajectorySeen,
    explain_buffer,
    explain_consumed,
)
from staleflow.coordinator.membership import InstanceStatus
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.ledger import BufferEntry, BufferState, BufferView, EntryStatus
from staleflow.servers.clients import ServiceError

if TYPE_CHECKING:
    from staleflow.coordinator.service import Coordinator, InstanceRecord

PAGE = 10_000  # the trajectory server's largest page
PROGRESS_TIMEOUT = 2.0  # seconds an instance may take to say what it holds; without it, its last checkpoints count


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


def explanation_json(answer: BufferExplanation) -> dict[str, Any]:
    return dataclasses.asdict(answer)


async def explain(coordinator: Coordinator, version: int) -> BufferExplanation:
    """Why buffer ``version`` is not consumable yet, from what the ledger, the trajectory server and
    the instances say now."""
    ledger = await _upstream("staleness manager", coordinator.manager.buffers())
    t, eta = ledger["train_version"], ledger["eta"]
    if version < t:
        consumed = await _upstream("staleness manager", coordinator.manager.buffer(version))
        return explain_consumed(version, t, ledger["batch_size"], [e["group_id"] for e in consumed["entries"]])
    if version > t + eta:
        raise StaleFlowError(ErrorCode.UNKNOWN_BUFFER, f"buffer {version} is not live yet: the live buffers are "
                             f"{t}..{t + eta}", version=version, train_version=t)
    views = [_buffer_view(b) for b in ledger["buffers"]]
    trajectories = await _upstream("trajectory server", _live_trajectories(coordinator.ts))
    waiting = {e.group_id for b in views for e in b.entries if e.status is EntryStatus.RESERVED}
    open_members = [t for t in trajectories if t.group_id in waiting and t.state in ("pending", "routed")]
    holders = {t.instance_id for t in open_members if t.instance_id in coordinator.instances
               and coordinator.instances[t.instance_id].status is not InstanceStatus.FAILED}
    held = dict(zip(holders, await asyncio.gather(*(_held(coordinator.instances[i]) for i in holders)), strict=True))
    instances = {i: _instance_seen(r, held.get(i)) for i, r in coordinator.instances.items()}
    max_tokens = await _upstream("trajectory server", _max_tokens(coordinator.ts, open_members))
    # off the event loop: the cycle goes on while a large ledger is replayed
    return await asyncio.to_thread(explain_buffer, version, t, ledger["batch_size"], ledger["group_size"], views,
                                   trajectories, instances, max_tokens)


async def _upstream(what: str, call: Any) -> Any:
    try:
        return await call
    except httpx.TransportError as exc:
        raise StaleFlowError(ErrorCode.UPSTREAM_UNAVAILABLE,
                             f"the {what} does not answer ({exc.__class__.__name__}); try again") from None
    except ServiceError as exc:
        raise StaleFlowError(ErrorCode.UPSTREAM_ERROR, f"the {what} refused: {exc}") from None


def _buffer_view(b: dict) -> BufferView:
    entries = tuple(BufferEntry(e["group_id"], e["v_traj"], EntryStatus(e["status"])) for e in b["entries"])
    return BufferView(b["version"], BufferState(b["state"]), b["capacity"], entries)


async def _live_trajectories(ts: httpx.AsyncClient) -> list[TrajectorySeen]:
    seen: list[TrajectorySeen] = []
    offset = 0
    while True:
        page = await _json(await ts.get("/v1/trajectories", params={"limit": PAGE, "offset": offset}))
        seen += [TrajectorySeen(t["traj_id"], t["group_id"], t["state"], t["generated"], t["instance_id"])
                 for t in page["trajectories"]]
        offset += len(page["trajectories"])
        if not page["trajectories"] or offset >= page["total"]:
            return seen


async def _max_tokens(ts: httpx.AsyncClient, open_members: list[TrajectorySeen]) -> int | None:
    """The response budget of the waiting trajectories (one trajectory server samples them all alike)."""
    for t in open_members[:3]:  # one that finished meanwhile has left the live set: try the next
        reply = await ts.get(f"/v1/trajectories/{t.traj_id}")
        if reply.status_code == 200:
            return reply.json()["sampling"].get("max_tokens")
    return None


async def _json(reply: httpx.Response) -> dict:
    if reply.status_code != 200:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        raise ServiceError(reply.status_code, str(detail))
    return reply.json()


async def _held(record: InstanceRecord) -> dict[str, int] | None:
    """What each trajectory on the instance holds now; None when it cannot say (its engine does not
    expose it, or it does not answer in time)."""
    try:
        reply = await record.client.get("/v1/progress", timeout=PROGRESS_TIMEOUT)
        body = reply.json()
    except (httpx.HTTPError, ValueError):
        return None
    if reply.status_code != 200 or not body.get("available"):
        return None
    return {k: int(v) for k, v in body.get("held", {}).items()}


def _instance_seen(record: InstanceRecord, held: dict[str, int] | None) -> InstanceSeen:
    snap = record.snapshot or {}
    return InstanceSeen(record.instance_id, record.status.value, frozenset(snap.get("run_trajs", [])),
                        frozenset(snap.get("wait_trajs", [])), float(snap.get("kv_cache", 0.0)), record.cost, held,
                        has_snapshot=record.snapshot is not None)
