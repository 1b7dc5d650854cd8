"""Why a staleness buffer is not consumable yet, and when the cost model expects it to be. Pure.

The ledger knows the buffers and their groups, the trajectory server where each trajectory is
(pending, routed to an instance, completed), the instances what they run and hold, and the cost
model what a decode step costs. ``explain_buffer`` combines those views, as the coordinator sees
them at one moment, into one answer.

What a buffer waits for
-----------------------
Buffer ``v`` can be consumed once the buffers before it are and it holds B occupied groups. Each
of the buffers ``t..v`` takes B occupied groups whose window reaches it, so they need ``needed``
more groups occupied (what they lack of B, counting an occupied group a buffer holds beyond B
towards the next one its window reaches). Without batch redundancy a reserved group whose window
ends by ``v`` trains in one of these buffers and takes a slot there: it must be occupied itself
(it is *required*). The other slots go to the first groups to be occupied among the other
reserved ones (any of them: their windows cover ``t..v``); slots that even all of them cannot
fill wait for groups not reserved yet. With batch redundancy a seal pins a batch and aborts what
no longer fits, so which groups can fill a slot depends on where the others sit: the answer
replays the ledger's own rules on a copy, occupying the reserved groups in the order they are
expected to finish, and names the ones it takes.

When
----
A trajectory routed to an instance finishes, at the latest, when it has generated ``max_tokens``
response tokens. Running, that takes ``CostModel.decode_time`` of the instance's current running
set and KV cache for the tokens it has left; queued, it starts when the first running trajectory
there finishes. The estimate takes every trajectory to ``max_tokens`` (the cost model knows no
response lengths), assumes the instance's running set stays as it is, and leaves out rewards and
training. A group is ready when its ``group_size``-th member finishes, the buffer when every
required group and the earliest of the candidates it needs are. A trajectory still pending at the
trajectory server, routed but not on its instance yet, or on an instance that failed has no
estimate; the answer then says which, and gives none for its group (or the buffer) rather than a
guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from staleflow.config.manager import LedgerParams
from staleflow.cost_model import CostModel
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.ledger import BufferView, Entry, EntryStatus, Ledger, LedgerError

MAX_PRUNE = 32  # groups tried for removal from a replay's answer: bounds the work on large ledgers
DONE_STATES = frozenset({"completed", "rewarded", "consumed"})
GONE_STATES = frozenset({"cancelling", "aborted"})


@dataclass(frozen=True)
class TrajectorySeen:
    """A trajectory as the trajectory server lists it."""

    traj_id: str
    group_id: str
    state: str  # pending, routed, completed, rewarded, cancelling, aborted, consumed
    generated: int  # response tokens the trajectory server holds
    instance_id: str | None = None


@dataclass(frozen=True)
class InstanceSeen:
    """An instance as the coordinator sees it: its last snapshot and, where asked, its progress."""

    instance_id: str
    status: str  # joining, live, syncing, failed
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    kv_cache: float = 0.0
    cost: CostModel = field(default_factory=CostModel)
    held: Mapping[str, int] | None = None  # traj_id -> response tokens on the engine now (None: not known)
    has_snapshot: bool = True


@dataclass(frozen=True)
class TrajectoryWait:
    traj_id: str
    state: str
    where: str  # in words
    instance_id: str | None
    generated: int  # response tokens so far (the instance's count when it reported one)
    max_tokens: int | None
    ready_in_s: float | None  # None: no estimate (``where`` says why), 0: done


@dataclass(frozen=True)
class GroupWait:
    group_id: str
    v_traj: int
    buffer: int  # the buffer the ledger places it in now
    required: bool  # its window ends by the buffer asked about (no redundancy): it must be occupied itself
    completed: int  # members completed
    needed: int  # members it needs completed (G)
    trajectories: tuple[TrajectoryWait, ...]
    ready_in_s: float | None
    note: str


@dataclass(frozen=True)
class BufferExplanation:
    version: int
    train_version: int
    state: str  # waiting, ready, stuck or consumed
    consumable: bool
    batch_size: int
    capacity: int
    occupied: int
    reserved: int
    empty: int
    needed: int  # groups still to be occupied before it is ready (in it and the buffers before it)
    unreserved: int  # of those, slots no live group can fill: they wait for groups not reserved yet
    consume_first: tuple[int, ...]  # buffers the trainer consumes before it
    groups: tuple[GroupWait, ...]  # required groups first, then candidates (if it needs any) by expected readiness
    ready_in_s: float | None
    estimate: str  # how the estimate was made, or why there is none
    summary: str


def explain_consumed(version: int, train_version: int, batch_size: int, groups: Iterable[str]) -> BufferExplanation:
    consumed = tuple(groups)
    return BufferExplanation(
        version, train_version, "consumed", False, batch_size, batch_size, len(consumed), 0, 0, 0, 0, (), (), 0.0,
        "already consumed",
        f"buffer {version} was already consumed: the trainer trained on its {len(consumed)} "
        f"group{'' if len(consumed) == 1 else 's'} and is now at version {train_version}, waiting for buffer "
        f"{train_version}")


def explain_buffer(
    version: int,
    train_version: int,
    batch_size: int,
    group_size: int,
    buffers: list[BufferView],
    trajectories: Iterable[TrajectorySeen],
    instances: Mapping[str, InstanceSeen],
    max_tokens: int | None,
) -> BufferExplanation:
    """Why live buffer ``version`` (one of ``buffers``, the ledger's ``t..t+eta``) is not
    consumable yet: what it holds, what it waits for, where that is, and when it is expected."""
    by_version = {b.version: b for b in buffers}
    if version not in by_version:
        raise StaleFlowError(ErrorCode.UNKNOWN_BUFFER, f"buffer {version} is not live: the live buffers are "
                             f"{buffers[0].version}..{buffers[-1].version}", version=version)
    view = by_version[version]
    prefix = [b for b in buffers if b.version <= version]
    B = batch_size
    eta = len(buffers) - 1
    redundant = any(b.capacity > B for b in buffers)
    needed = _shortfall(prefix, B, eta)
    consume_first = tuple(range(train_version, version))
    reserved = len(view.entries) - view.occupied
    empty = max(0, view.capacity - len(view.entries))
    head = version == train_version
    consumable = head and view.state == "ready"
    base: dict[str, Any] = dict(version=version, train_version=train_version, state=view.state.value, consumable=consumable,
                batch_size=B, capacity=view.capacity, occupied=view.occupied, reserved=reserved, empty=empty,
                needed=needed, consume_first=consume_first)
    if needed == 0:
        if consumable:
            summary = f"buffer {version} is ready: {view.occupied} occupied groups; the trainer can consume it now"
        else:
            summary = (f"buffer {version} holds its {B} occupied groups, as do the ones before it; the trainer "
                       f"consumes {_buffers(consume_first)} first")
        return BufferExplanation(**base, unreserved=0, groups=(), ready_in_s=0.0,
                                 estimate="nothing left to generate; training the buffers before it is not estimated"
                                 if consume_first else "ready now", summary=summary)

    members: dict[str, list[TrajectorySeen]] = {}
    for t in trajectories:
        members.setdefault(t.group_id, []).append(t)
    finish = _finish_times(members, instances, max_tokens)

    reserved_entries = [(b.version, e.group_id, e.v_traj) for b in buffers for e in b.entries
                        if e.status is EntryStatus.RESERVED]
    # without redundancy a group whose window ends by `version` trains in one of these buffers, which
    # are full only once it is occupied; with redundancy it may be aborted as surplus instead
    required_entries = [] if redundant else [r for r in reserved_entries if r[2] + eta <= version]
    candidate_entries = [r for r in reserved_entries if redundant or r[2] + eta > version]
    from_candidates = needed - len(required_entries)
    unreserved = max(0, from_candidates - len(candidate_entries))
    required = [_group(g, v, b, True, members.get(g, []), group_size, finish, max_tokens)
                for b, g, v in required_entries]
    candidates = [_group(g, v, b, False, members.get(g, []), group_size, finish, max_tokens)
                  for b, g, v in candidate_entries]
    candidates.sort(key=lambda g: (g.ready_in_s is None, g.ready_in_s or 0.0, g.buffer))
    if candidates and from_candidates > 0:
        # which groups can fill a slot depends on where the ledger must keep room for the others
        # (a group with a later deadline cannot take a slot the earlier ones all need) and, with
        # redundancy, on what a seal aborts: replay the ledger's own rules, occupying the required
        # groups and then the others in the order they are expected to finish
        first = [g.group_id for g in required]
        used, unreserved = _replay(buffers, B, train_version, version, [*first, *(g.group_id for g in candidates)],
                                   needed)
        candidates = [g for g in candidates if g.group_id in used] if unreserved == 0 else candidates
        from_candidates = len(candidates) if unreserved == 0 else len(candidates) + unreserved

    ready_in, estimate = _buffer_estimate(required, candidates, from_candidates, unreserved)
    if consume_first and ready_in is not None:
        estimate += f"; {_buffers(consume_first)} must be consumed first (training time not estimated)"
    summary = _summary(version, view, B, needed, required, candidates, from_candidates, unreserved, consume_first,
                       ready_in, estimate, redundant)
    useful = candidates if from_candidates > 0 else []  # none of them can fill a slot it needs
    return BufferExplanation(**base, unreserved=unreserved, groups=(*required, *useful), ready_in_s=ready_in,
                             estimate=estimate, summary=summary)


def _rebuild(buffers: list[BufferView], batch_size: int, train_version: int) -> Ledger:
    """A ledger holding what the views show: the same entries, placement and seal. Admission order
    is what the placement implies (occupied groups earliest first, reservations latest first)."""
    eta = len(buffers) - 1
    capacity = max(b.capacity for b in buffers)
    params = LedgerParams(eta=eta, batch_size=batch_size, batch_redundancy=(capacity - batch_size) / batch_size)
    occupied = [e for b in buffers for e in b.entries if e.status is EntryStatus.OCCUPIED]
    reserved = [e for b in reversed(buffers) for e in b.entries if e.status is EntryStatus.RESERVED]
    entries = [Entry(e.group_id, e.v_traj, e.v_traj + eta, e.status, seq,
                     seq if e.status is EntryStatus.OCCUPIED else None)
               for seq, e in enumerate([*occupied, *reserved], start=1)]
    head = buffers[0]
    sealed = [e.group_id for e in head.entries] if head.capacity < capacity else []
    return Ledger.restore(params, train_version, entries, {}, sealed)


def _copy(ledger: Ledger) -> Ledger:
    return Ledger.restore(ledger.params, ledger.train_version, [e.copy() for e in ledger.entries()], {}, ledger.sealed)


def _consumable_through(ledger: Ledger, version: int, occupy: list[str]) -> tuple[bool, list[str]]:
    """On a copy: occupy these groups (those still live: a seal may abort others as surplus), then
    can the trainer consume every buffer up to ``version``? Returns that and the groups occupied."""
    copy = _copy(ledger)
    done = []
    for g in occupy:
        entry = copy.entry(g)
        if entry is not None and entry.status is EntryStatus.RESERVED:
            copy.occupy(g)
            done.append(g)
    try:
        while copy.train_version <= version:
            copy.consume()
    except LedgerError:
        return False, done
    return True, done


def _replay(buffers: list[BufferView], batch_size: int, train_version: int, version: int,
            order: list[str], fewest: int) -> tuple[list[str], int]:
    """Occupy reserved groups in ``order`` on a ledger rebuilt from the views until every buffer up
    to ``version`` can be consumed: the groups that took, less those it turns out not to need (an
    early group that could not take a slot), and 0; or, when all of them are not enough, all of
    them and how many more groups it needs. ``fewest``: a lower bound on the groups it needs."""
    ledger = _rebuild(buffers, batch_size, train_version)
    low, high = 0, len(order)  # consumability only grows with the groups occupied: bisect the fewest
    if not _consumable_through(ledger, version, order)[0]:
        copy = _copy(ledger)
        for g in order:
            if copy.entry(g) is not None:
                copy.occupy(g)
        prefix = [b for b in copy.buffers() if b.version <= version]
        return order, max(1, _shortfall(prefix, batch_size, len(buffers) - 1))
    while low < high:
        middle = (low + high) // 2
        if _consumable_through(ledger, version, order[:middle])[0]:
            high = middle
        else:
            low = middle + 1
    used = _consumable_through(ledger, version, order[:low])[1]
    for g in list(used[:-1])[:MAX_PRUNE]:  # the last one is needed: without it, it was not consumable
        if len(used) <= fewest:
            break
        without = [u for u in used if u != g]
        if _consumable_through(ledger, version, without)[0]:
            used = without
    return used, 0


def _shortfall(prefix: list[BufferView], batch_size: int, eta: int) -> int:
    """How many more occupied groups buffers ``prefix`` need to be consumed one after the other:
    each takes B occupied groups whose window reaches it, earliest deadline first; an occupied group
    a buffer holds beyond B moves on to the next one if its window reaches that far."""
    carried: list[int] = []  # deadlines of the occupied groups not trained yet
    short = 0
    for view in prefix:
        carried = sorted([d for d in carried if d >= view.version]
                         + [e.v_traj + eta for e in view.entries if e.status is EntryStatus.OCCUPIED])
        taken = min(batch_size, len(carried))
        carried = carried[taken:]
        short += batch_size - taken
    return short


def _finish_times(members: dict[str, list[TrajectorySeen]], instances: Mapping[str, InstanceSeen],
                  max_tokens: int | None) -> dict[str, tuple[float | None, str, int]]:
    """traj_id -> (seconds until it finishes or None, where it is in words, tokens generated)."""
    generated: dict[str, int] = {}
    for group in members.values():
        for t in group:
            inst = instances.get(t.instance_id or "")
            held = inst.held.get(t.traj_id) if inst is not None and inst.held is not None else None
            generated[t.traj_id] = max(t.generated, held or 0)
    on_instance: dict[str, dict[str, float | None]] = {}  # instance -> running traj -> seconds left

    def running_times(inst: InstanceSeen) -> dict[str, float | None]:
        if inst.instance_id not in on_instance:
            n = len(inst.running)
            on_instance[inst.instance_id] = {
                traj: None if max_tokens is None or traj not in generated else
                inst.cost.decode_time(inst.kv_cache, n, max(0, max_tokens - generated[traj]))
                for traj in inst.running}
        return on_instance[inst.instance_id]

    out: dict[str, tuple[float | None, str, int]] = {}
    for group in members.values():
        for t in group:
            done = generated[t.traj_id]
            inst = instances.get(t.instance_id or "")
            if t.state in DONE_STATES:
                out[t.traj_id] = (0.0, "completed" if t.state == "completed" else t.state, done)
            elif t.state in GONE_STATES:
                out[t.traj_id] = (None, f"{t.state} (its group no longer needs it)", done)
            elif t.state == "pending":
                out[t.traj_id] = (None, "pending at the trajectory server: not routed to an instance yet", done)
            elif inst is None:
                out[t.traj_id] = (None, f"routed to {t.instance_id}, which the coordinator does not know", done)
            elif inst.status == "failed":
                out[t.traj_id] = (None, f"routed to {inst.instance_id}, which failed: it goes back to pending", done)
            elif not inst.has_snapshot:
                out[t.traj_id] = (None, f"routed to {inst.instance_id}, which has sent no snapshot yet", done)
            elif t.traj_id in inst.running:
                out[t.traj_id] = (running_times(inst)[t.traj_id], f"running on {inst.instance_id}{_pause(inst)}", done)
            elif t.traj_id in inst.waiting:
                times = running_times(inst)
                known = [s for s in times.values() if s is not None]
                start = min(known, default=0.0) if len(known) == len(times) else None
                left = None if max_tokens is None else max(0, max_tokens - done)
                seconds = None if start is None or left is None else (
                    start + inst.cost.decode_time(inst.kv_cache, len(inst.running), left))
                out[t.traj_id] = (seconds, f"queued on {inst.instance_id}{_pause(inst)}", done)
            else:
                out[t.traj_id] = (None, f"routed to {inst.instance_id}, not in its last snapshot yet", done)
    return out


def _pause(inst: InstanceSeen) -> str:
    return " (pulling new weights: the estimate leaves the pause out)" if inst.status == "syncing" else ""


def _group(group_id: str, v_traj: int, buffer: int, required: bool, members: list[TrajectorySeen], group_size: int,
           finish: dict[str, tuple[float | None, str, int]], max_tokens: int | None) -> GroupWait:
    waits = []
    for t in sorted(members, key=lambda t: t.traj_id):
        seconds, where, generated = finish[t.traj_id]
        waits.append(TrajectoryWait(t.traj_id, t.state, where, t.instance_id, generated, max_tokens, seconds))
    completed = sum(t.state in DONE_STATES for t in members)
    left = group_size - completed
    if left <= 0:
        return GroupWait(group_id, v_traj, buffer, required, completed, group_size, tuple(waits), 0.0,
                         f"{completed} of {group_size} members completed: occupied once their rewards are in")
    open_members = [w for w in waits if w.state not in DONE_STATES and w.state not in GONE_STATES]
    if not members:
        return GroupWait(group_id, v_traj, buffer, required, 0, group_size, (), None,
                         "the trajectory server lists none of its trajectories")
    known = sorted(w.ready_in_s for w in open_members if w.ready_in_s is not None)
    if len(known) >= left:
        seconds: float | None = known[left - 1]
        note = f"{completed} of {group_size} members completed; {left} more expected in {seconds:.1f} s"
    else:
        seconds = None
        unknown = [w for w in open_members if w.ready_in_s is None]
        why = "max_tokens is unknown" if max_tokens is None and open_members else (
            f"{len(unknown)} of its trajectories cannot be estimated ({_where_counts(unknown)})" if unknown
            else f"only {len(open_members)} members still run")
        note = f"{completed} of {group_size} members completed; {left} more needed; no estimate: {why}"
    return GroupWait(group_id, v_traj, buffer, required, completed, group_size, tuple(waits), seconds, note)


def _where_counts(waits: list[TrajectoryWait]) -> str:
    counts: dict[str, int] = {}
    for w in waits:
        kind = w.where.split(":")[0] if w.state == "pending" else w.where
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


def _buffer_estimate(required: list[GroupWait], candidates: list[GroupWait], from_candidates: int,
                     unreserved: int) -> tuple[float | None, str]:
    if unreserved:
        return None, (f"cannot estimate: {unreserved} slot{'s' if unreserved != 1 else ''} wait for groups that are "
                      "not reserved yet (see admission)")
    blocked = [g for g in required if g.ready_in_s is None]
    if blocked:
        return None, f"cannot estimate {_names(blocked)}: {_why(blocked[0])}"
    times = [g.ready_in_s or 0.0 for g in required]
    if from_candidates > 0:
        chosen = candidates[:from_candidates]
        missing = [g for g in chosen if g.ready_in_s is None]
        if missing:
            return None, (f"cannot estimate: only {from_candidates - len(missing)} of the {from_candidates} groups it "
                          f"needs from later buffers have an estimate ({missing[0].group_id}: {_why(missing[0])})")
        times += [g.ready_in_s or 0.0 for g in chosen]
    return max(times, default=0.0), ("cost model: each unfinished trajectory runs to max_tokens on its instance at "
                                     "its current load; rewards not included")


def _why(group: GroupWait) -> str:
    return group.note.split("no estimate: ", 1)[-1]


def _summary(version: int, view: BufferView, B: int, needed: int, required: list[GroupWait],
             candidates: list[GroupWait], from_candidates: int, unreserved: int, consume_first: tuple[int, ...],
             ready_in: float | None, estimate: str, redundant: bool) -> str:
    parts = [f"buffer {version} is {view.state.value}: {view.occupied} of {B} groups occupied, "
             f"{len(view.entries) - view.occupied} reserved, {max(0, view.capacity - len(view.entries))} empty"]
    if consume_first:
        parts.append(f"it is consumed after {_buffers(consume_first)}")
    waits = []
    if required:
        waits.append(f"{_names(required)} (whose windows end by buffer {version}: "
                     f"{'each' if len(required) > 1 else 'it'} must be occupied)")
    if candidates and not unreserved:
        waits.append(f"{_names(candidates)} (the first groups expected to finish that make it ready, by the "
                     "ledger's own rules)")
    elif from_candidates - unreserved > 0:
        waits.append(f"{from_candidates - unreserved} of the {len(candidates)} other reserved groups (the first to "
                     "be occupied take the slots)")
    if unreserved:
        waits.append(f"{unreserved} group{'s' if unreserved != 1 else ''} not reserved yet")
    parts.append(f"it needs {'at least ' if redundant else ''}{needed} more occupied group{'s' if needed != 1 else ''}"
                 f": " + ", ".join(waits))
    parts.append(f"expected ready in {ready_in:.1f} s" if ready_in is not None else estimate)
    return "; ".join(parts)


def _names(groups: list[GroupWait], most: int = 5) -> str:
    names = ", ".join(g.group_id for g in groups[:most])
    more = f" and {len(groups) - most} more" if len(groups) > most else ""
    return f"group{'s' if len(groups) > 1 else ''} {names}{more}"


def _buffers(versions: tuple[int, ...]) -> str:
    if len(versions) == 1:
        return f"buffer {versions[0]}"
    if versions == tuple(range(versions[0], versions[-1] + 1)):
        return f"buffers {versions[0]}..{versions[-1]}"
    return "buffers " + ", ".join(map(str, versions))
