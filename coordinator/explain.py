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

from staleflow.api.base import ServiceError
from staleflow.api.manager import BufferOut
from staleflow.api.trajectories import AsyncTrajectoryClient
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

if TYPE_CHECKING:
    from staleflow.coordinator.service import Coordinator, InstanceRecord

PAGE = 10_000  # the trajectory server's largest page
PROGRESS_TIMEOUT = 2.0  # seconds an instance may take to say what it holds; without it, its last checkpoints count


def explanation_json(answer: BufferExplanation) -> dict[str, Any]:
    return dataclasses.asdict(answer)


async def explain(coordinator: Coordinator, version: int) -> BufferExplanation:
    """Why buffer ``version`` is not consumable yet, from what the ledger, the trajectory server and
    the instances say now."""
    ledger = await _upstream("staleness manager", coordinator.manager.buffers())
    t, eta = ledger.train_version, ledger.eta
    if version < t:
        consumed = await _upstream("staleness manager", coordinator.manager.buffer(version))
        return explain_consumed(version, t, ledger.batch_size, [e.group_id for e in consumed.entries])
    if version > t + eta:
        raise StaleFlowError(ErrorCode.UNKNOWN_BUFFER, f"buffer {version} is not live yet: the live buffers are "
                             f"{t}..{t + eta}", version=version, train_version=t)
    views = [_buffer_view(b) for b in ledger.buffers]
    trajectories = await _upstream("trajectory server", _live_trajectories(coordinator.ts))
    waiting = {e.group_id for b in views for e in b.entries if e.status is EntryStatus.RESERVED}
    open_members = [t for t in trajectories if t.group_id in waiting and t.state in ("pending", "routed")]
    holders = {t.instance_id for t in open_members if t.instance_id in coordinator.instances
               and coordinator.instances[t.instance_id].status is not InstanceStatus.FAILED}
    held = dict(zip(holders, await asyncio.gather(*(_held(coordinator.instances[i]) for i in holders)), strict=True))
    instances = {i: _instance_seen(r, held.get(i)) for i, r in coordinator.instances.items()}
    max_tokens = await _upstream("trajectory server", _max_tokens(coordinator.ts, open_members))
    # off the event loop: the cycle goes on while a large ledger is replayed
    return await asyncio.to_thread(explain_buffer, version, t, ledger.batch_size, ledger.group_size, views,
                                   trajectories, instances, max_tokens)


async def _upstream(what: str, call: Any) -> Any:
    try:
        return await call
    except httpx.TransportError as exc:
        raise StaleFlowError(ErrorCode.UPSTREAM_UNAVAILABLE,
                             f"the {what} does not answer ({exc.__class__.__name__}); try again") from None
    except ServiceError as exc:
        raise StaleFlowError(ErrorCode.UPSTREAM_ERROR, f"the {what} refused: {exc}") from None


def _buffer_view(b: BufferOut) -> BufferView:
    entries: list[BufferEntry] = []
    for e in b.entries:
        if e.v_traj is None:  # the buffer listing gives every live entry's V_traj
            raise StaleFlowError(ErrorCode.UPSTREAM_ERROR, f"the staleness manager listed group {e.group_id} without its v_traj")
        entries.append(BufferEntry(e.group_id, e.v_traj, EntryStatus(e.status)))
    return BufferView(b.version, BufferState(b.state), b.capacity, tuple(entries))


async def _live_trajectories(ts: AsyncTrajectoryClient) -> list[TrajectorySeen]:
    seen: list[TrajectorySeen] = []
    offset = 0
    while True:
        page = await ts.trajectories(limit=PAGE, offset=offset)
        seen += [TrajectorySeen(t.traj_id, t.group_id, t.state, t.generated, t.instance_id) for t in page.trajectories]
        offset += len(page.trajectories)
        if not page.trajectories or offset >= page.total:
            return seen


async def _max_tokens(ts: AsyncTrajectoryClient, open_members: list[TrajectorySeen]) -> int | None:
    """The response budget of the waiting trajectories (one trajectory server samples them all alike)."""
    for t in open_members[:3]:  # one that finished meanwhile has left the live set: try the next
        try:
            return (await ts.trajectory(t.traj_id)).sampling.max_tokens
        except ServiceError:
            continue
    return None


async def _held(record: InstanceRecord) -> dict[str, int] | None:
    """What each trajectory on the instance holds now; None when it cannot say (its engine does not
    expose it, or it does not answer in time)."""
    try:
        progress = await record.client.progress(timeout=PROGRESS_TIMEOUT)
    except (httpx.HTTPError, ServiceError, ValueError):
        return None
    return dict(progress.held) if progress.available else None


def _instance_seen(record: InstanceRecord, held: dict[str, int] | None) -> InstanceSeen:
    snap = record.snapshot
    if snap is None:
        return InstanceSeen(record.instance_id, record.status.value, frozenset(), frozenset(), 0.0, record.cost, held,
                            has_snapshot=False)
    return InstanceSeen(record.instance_id, record.status.value, frozenset(snap.run_trajs), frozenset(snap.wait_trajs),
                        float(snap.kv_cache), record.cost, held, has_snapshot=True)
