"""The staleness ledger: Reserve / Occupy / Consume over virtual staleness buffers.

Pure logic, no I/O (paper §4.2-4.3). The durable service in ``staleflow.servers.manager.store``
persists the ``changes`` every transition returns before acknowledging it.

Model
-----
The trainer version ``t`` is the number of buffers consumed so far; buffer ``b`` trains version
``b -> b + 1``. A live entry is one prompt group with version ``v`` (its V_traj) and must be
trained from a buffer ``b`` with ``max(v, t) <= b <= v + eta``. Because no trajectory can carry a
version the trainer has not produced yet (``v <= t``), every window is a *prefix* ``[t, v + eta]``
of the live buffers. Hall's theorem then says a set of entries fits into buffers of capacity
``C`` exactly when, for every deadline ``d``, the entries with deadline ``<= d`` number at most
``C * (d - t + 1)``. Admission is that check, so it is maximal: a reservation is refused only when
no placement of all live entries plus the new one exists.

Placement is derived, never stored: reserved entries are placed as late as possible (the paper's
worst-case Reserve) and occupied entries fill the remaining slots earliest-deadline-first (greedy
Occupy). That placement is the fixpoint of the paper's entry deletion and movement procedure
(Figure 7 right): occupied entries sit in the earliest buffers, reserved ones in the latest.

Redundancy (paper §4.3, Appendix C): with batch-level redundancy each window admits
``C = B + floor(B * ratio)`` groups; when buffer ``t`` first holds ``B`` occupied entries it is
*sealed* with exactly those, and every entry that can no longer be placed is aborted as surplus
and reported in ``Transition.cancelled`` so the rollout side can cancel it. With group-level
redundancy a group is occupied once ``group_size`` of its members have completed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from staleflow.config.manager import LedgerParams
from staleflow.errors import ErrorCode, StaleFlowError


class EntryStatus(StrEnum):
    RESERVED = "reserved"
    OCCUPIED = "occupied"


class BufferState(StrEnum):
    WAITING = "waiting"
    READY = "ready"
    STUCK = "stuck"


class GroupFate(StrEnum):
    """How a group left the ledger."""

    CONSUMED = "consumed"
    ABORTED = "aborted"  # asked for: filtering, cancelled rollouts, dead instances
    SURPLUS = "surplus"  # redundancy: no longer placeable once a buffer was sealed


class LedgerError(StaleFlowError):
    """A refused transition."""


@dataclass
class Entry:
    group_id: str
    v_traj: int
    deadline: int  # v_traj + eta: the last buffer it may train in
    status: EntryStatus
    seq: int  # admission order
    occupied_seq: int | None = None
    completed: tuple[str, ...] = ()  # members completed so far (group-level redundancy)

    def copy(self) -> Entry:
        return Entry(self.group_id, self.v_traj, self.deadline, self.status, self.seq, self.occupied_seq, self.completed)


# --- changes: what a transition did, for the durable store --------------------------------


@dataclass(frozen=True)
class PutEntry:
    entry: Entry
    new: bool = False


@dataclass(frozen=True)
class RetireEntry:
    group_id: str
    v_traj: int
    fate: GroupFate
    buffer: int  # the trainer version at the time (the buffer it was consumed in)


@dataclass(frozen=True)
class SetTrainVersion:
    train_version: int


@dataclass(frozen=True)
class SetSealed:
    group_ids: tuple[str, ...]


Change = PutEntry | RetireEntry | SetTrainVersion | SetSealed


@dataclass
class Transition:
    op: str
    group_id: str | None = None
    buffer: int | None = None
    consumed: list[str] | None = None
    cancelled: list[str] = field(default_factory=list[str])  # aborted as a side effect
    completed_members: list[str] | None = None
    changes: list[Change] = field(default_factory=list[Change])


@dataclass(frozen=True)
class BufferEntry:
    group_id: str
    v_traj: int
    status: EntryStatus


@dataclass(frozen=True)
class BufferView:
    version: int
    state: BufferState
    capacity: int
    entries: tuple[BufferEntry, ...]

    @property
    def occupied(self) -> int:
        return sum(e.status is EntryStatus.OCCUPIED for e in self.entries)


@dataclass(frozen=True)
class AdmissionWhatIf:
    """Whether ``count`` more groups with V_traj ``version`` could be reserved now, and if not, why
    and what has to happen first. Asking never changes the ledger."""

    version: int
    count: int
    train_version: int
    room: int  # groups with this V_traj that fit now
    reason: str
    full_buffers: tuple[int, ...] = ()  # the buffers with no free slot in the first window prefix `count` overflows
    consume_through: int | None = None  # consume buffers train_version..this first: then `count` groups fit
    then_version: int | None = None  # the V_traj those groups could carry then (None: admissible now, or never)
    then_room: int | None = None  # how many groups of `then_version` fit then (an estimate once buffers are consumed)

    @property
    def admissible(self) -> bool:
        return self.count <= self.room


def _buffers(first: int, last: int) -> str:
    return f"buffer {first}" if first == last else f"buffers {first}..{last}"


class Ledger:
    """In-memory ledger state and its transition rules."""

    def __init__(self, params: LedgerParams, train_version: int = 0):
        if train_version < 0:
            raise ValueError("train_version must be >= 0")
        self.params = params
        self.train_version = train_version
        self._entries: dict[str, Entry] = {}
        # live, unsealed entries by deadline; dicts keep admission / occupation order
        self._reserved: dict[int, dict[str, None]] = {}
        self._occupied: dict[int, dict[str, None]] = {}
        self._sealed: list[str] = []
        self._retired: dict[str, GroupFate] = {}
        self._retired_at: dict[int, list[str]] = {}  # the train version each group in _retired retired at
        # where groups retired long ago are found once they left memory (a durable ledger's table); None: memory
        # keeps every retired group
        self.archive: Callable[[str], GroupFate | None] | None = None
        self._seq = 0
        self._changes: list[Change] = []

    # ------------------------------------------------------------------ restore

    @classmethod
    def restore(
        cls,
        params: LedgerParams,
        train_version: int,
        entries: Iterable[Entry],
        retired: dict[str, GroupFate],
        sealed: Iterable[str] = (),
    ) -> Ledger:
        ledger = cls(params, train_version)
        ledger._retired = dict(retired)
        ledger._retired_at = {train_version: list(ledger._retired)} if ledger._retired else {}
        sealed = list(sealed)
        sealed_set = set(sealed)
        entries = list(entries)
        for e in sorted(entries, key=lambda e: e.seq):
            if e.deadline != e.v_traj + params.eta:
                raise ValueError(f"entry {e.group_id} was stored with another eta")
            ledger._entries[e.group_id] = e
            ledger._seq = max(ledger._seq, e.seq + 1, (e.occupied_seq or 0) + 1)
            if e.status is EntryStatus.RESERVED:
                ledger._reserved.setdefault(e.deadline, {})[e.group_id] = None
        occupied = [e for e in entries if e.status is EntryStatus.OCCUPIED]
        for e in sorted(occupied, key=lambda e: e.occupied_seq or 0):
            if e.group_id not in sealed_set:
                ledger._occupied.setdefault(e.deadline, {})[e.group_id] = None
        ledger._sealed = [g for g in sealed if g in ledger._entries]
        return ledger

    # ------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        return self.params.capacity

    @property
    def redundant(self) -> bool:
        return self.params.capacity > self.params.batch_size

    def entry(self, group_id: str) -> Entry | None:
        return self._entries.get(group_id)

    def entries(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.seq)

    def fate(self, group_id: str) -> GroupFate | None:
        fate = self._retired.get(group_id)
        if fate is None and self.archive is not None:
            fate = self.archive(group_id)
        return fate

    def forget_retired(self, before_version: int) -> int:
        """Groups retired before this train version leave memory; ``archive`` answers for them
        from then on (ids stay single-use). Only for groups whose retirement is durable, and only
        with an ``archive``. Returns how many left."""
        if self.archive is None:
            raise ValueError("retired groups can leave memory only with an archive that still knows them")
        gone = 0
        for version in [v for v in self._retired_at if v < before_version]:
            for group_id in self._retired_at.pop(version):
                gone += self._retired.pop(group_id, None) is not None
        return gone

    @property
    def sealed(self) -> tuple[str, ...]:
        return tuple(self._sealed)

    @property
    def retired_count(self) -> int:
        """Retired groups held in memory (all of them, unless ``forget_retired`` was called)."""
        return len(self._retired)

    def counts(self) -> dict[str, int]:
        reserved = sum(len(d) for d in self._reserved.values())
        occupied = len(self._entries) - reserved
        return {"reserved": reserved, "occupied": occupied, "live": len(self._entries)}

    def admissible(self, v_traj: int) -> int:
        """How many new reservations with this V_traj fit now (0 when none)."""
        self._check_version(v_traj)
        k = v_traj + self.params.eta - self.train_version
        if k < 0:
            return 0
        return max(0, min(self._prefix_slack()[k:]))

    def admission(self, versions: Iterable[int] | None = None) -> dict[int, int]:
        """Admissible reservation counts for each proposed V_traj, in one pass."""
        table = self._admission_counts()
        if versions is None:
            return table
        result: dict[int, int] = {}
        for v in versions:
            if v < 0:
                raise LedgerError(ErrorCode.INVALID_VERSION, f"v_traj must be >= 0, got {v}")
            result[v] = table.get(v, 0)
        return result

    def what_if(self, version: int, count: int) -> AdmissionWhatIf:
        """Could ``count`` more groups with V_traj ``version`` be reserved now? If not: which
        buffers are full, and which must be consumed before that many groups fit (at ``version``
        or, when it can never get that room, the oldest version that can). Pure: no state changes."""
        # the types are checked again: callers pass values decoded from JSON
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise LedgerError(ErrorCode.INVALID_VERSION, f"version must be an integer >= 0, got {version!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise LedgerError(ErrorCode.INVALID_REQUEST, f"count must be an integer >= 1, got {count!r}")
        t, eta, C = self.train_version, self.params.eta, self.capacity
        ask = f"{count} group{'s' if count != 1 else ''} with v_traj {version}"
        fits, misses = ("fit", "do not fit") if count != 1 else ("fits", "does not fit")
        room = self.admission([version])[version] if version <= t else 0
        if count <= room:
            return AdmissionWhatIf(version, count, t, room, f"{ask} {fits} now: room for {room}")
        full: tuple[int, ...] = ()
        if version > t:
            why = f"version {version} does not exist yet: the trainer is at {t}"
        elif version + eta < t:
            why = (f"v_traj {version} is too stale: with eta={eta} it could train at most version {version + eta}, "
                   f"and the trainer is at {t}")
        else:
            slack = self._prefix_slack()
            k = version + eta - t
            end = next(j for j in range(k, eta + 1) if slack[j] < count)
            views = self.buffers()[: end + 1]
            full = tuple(v.version for v in views if len(v.entries) >= v.capacity)
            held = sum(len(v.entries) for v in views)
            why = (f"{_buffers(t, t + end)} hold{'s' if end == 0 else ''} {held} groups in "
                   f"{sum(v.capacity for v in views)} slots: "
                   f"room for {max(0, slack[end])} more with a deadline by buffer {t + end}, not {count}")
        then = self._room_after_consuming(version, count)
        if then is None:
            return AdmissionWhatIf(version, count, t, room, f"{ask} {misses}: {why}; no version ever fits "
                                   f"{count}: a window holds {C * (eta + 1)} groups", full)
        through, then_version, then_room = then
        if through is not None:
            plan = (f"consume {_buffers(t, through)} first: then v_traj {then_version} "
                    f"has room for about {then_room}")
        else:
            plan = f"v_traj {then_version} has room for {then_room} now"
        return AdmissionWhatIf(version, count, t, room, f"{ask} {misses}: {why}; {plan}", full, through,
                               then_version, then_room)

    def _room_after_consuming(self, version: int, count: int) -> tuple[int | None, int, int] | None:
        """The fewest buffers to consume (and the version) for ``count`` groups of V_traj ``version``
        or newer to fit: ``(the last buffer to consume or None, version, room)``; None when no window
        holds that many. Once
        buffers are consumed the room is an estimate: the entries now placed in the buffers that
        remain stay, the consumed buffers' entries leave."""
        t, eta, C = self.train_version, self.params.eta, self.capacity
        if count > C * (eta + 1):
            return None
        views = self.buffers()
        for m in range(max(0, version - t), max(version - t, eta + 1) + 1):
            newest = t + m
            if m == 0:
                room = self.admission([newest])[newest]
            else:
                room = C * (eta + 1) - sum(len(v.entries) for v in views[m:])
            if room >= count:
                return (newest - 1 if m else None), max(version, newest), room
        raise AssertionError("a fresh window holds C * (eta + 1) groups")

    def _admission_counts(self) -> dict[int, int]:
        t, eta = self.train_version, self.params.eta
        slack = self._prefix_slack()
        # admitting n entries with deadline offset k needs n <= min(slack[k:])
        suffix_min = [0] * (eta + 1)
        running = math.inf
        for k in range(eta, -1, -1):
            running = min(running, slack[k])
            suffix_min[k] = max(0, int(running))
        return {v: suffix_min[v + eta - t] for v in range(max(0, t - eta), t + 1)}

    def _capacities(self) -> list[int]:
        caps = [self.capacity] * (self.params.eta + 1)
        if self._sealed:
            caps[0] = 0  # buffer t holds exactly the sealed batch
        return caps

    def _class_counts(self) -> tuple[list[int], list[int]]:
        """Unsealed reserved / occupied counts by deadline offset (deadline - t)."""
        t, size = self.train_version, self.params.eta + 1
        reserved, occupied = [0] * size, [0] * size
        for d, groups in self._reserved.items():
            reserved[d - t] += len(groups)
        for d, groups in self._occupied.items():
            occupied[d - t] += len(groups)
        return reserved, occupied

    def _prefix_slack(self, counts: tuple[list[int], list[int]] | None = None) -> list[int]:
        reserved, occupied = counts or self._class_counts()
        slack: list[int] = []
        cap_sum = used = 0
        for cap, r, o in zip(self._capacities(), reserved, occupied, strict=True):
            cap_sum += cap
            used += r + o
            slack.append(cap_sum - used)
        return slack

    def _placement(self) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
        """Per buffer offset: {deadline offset: count} of reserved and of occupied entries."""
        caps = self._capacities()
        reserved, occupied = self._class_counts()
        n = len(caps)
        res_at: list[dict[int, int]] = [{} for _ in range(n)]
        occ_at: list[dict[int, int]] = [{} for _ in range(n)]
        # reserved: latest buffers first, latest deadlines first
        left = list(reserved)
        for b in range(n - 1, -1, -1):
            free = caps[b]
            for k in range(n - 1, b - 1, -1):
                if free == 0:
                    break
                take = min(free, left[k])
                if take:
                    res_at[b][k] = take
                    left[k] -= take
                    free -= take
        # occupied: earliest buffers first, earliest deadlines first
        left = list(occupied)
        for b in range(n):
            free = caps[b] - sum(res_at[b].values())
            for k in range(b, n):
                if free == 0:
                    break
                take = min(free, left[k])
                if take:
                    occ_at[b][k] = take
                    left[k] -= take
                    free -= take
        return res_at, occ_at

    def buffers(self) -> list[BufferView]:
        """Every live buffer (t .. t + eta) with its state and entries."""
        t, eta, B = self.train_version, self.params.eta, self.params.batch_size
        res_at, occ_at = self._placement()
        reserved_queues = {
            k: list(self._reserved.get(t + k, {})) for k in range(eta + 1)
        }  # seq order: the earliest reservation sits in the latest buffer
        occupied_queues = {k: list(self._occupied.get(t + k, {})) for k in range(eta + 1)}
        placed: list[list[BufferEntry]] = [[] for _ in range(eta + 1)]
        for b in range(eta, -1, -1):
            for k in sorted(res_at[b], reverse=True):
                for _ in range(res_at[b][k]):
                    g = reserved_queues[k].pop(0)
                    placed[b].append(self._view_entry(g))
        for b in range(eta + 1):
            for k in sorted(occ_at[b]):
                for _ in range(occ_at[b][k]):
                    g = occupied_queues[k].pop(0)
                    placed[b].append(self._view_entry(g))
        if self._sealed:
            placed[0] = [self._view_entry(g) for g in self._sealed]
        views: list[BufferView] = []
        caps = self._capacities()
        for b in range(eta + 1):
            entries = sorted(placed[b], key=lambda e: (e.status != EntryStatus.OCCUPIED, self._entries[e.group_id].seq))
            capacity = B if (b == 0 and self._sealed) else caps[b]
            occupied = sum(e.status is EntryStatus.OCCUPIED for e in entries)
            if occupied >= B:
                state = BufferState.READY
            elif len(entries) >= capacity:
                state = BufferState.STUCK
            else:
                state = BufferState.WAITING
            views.append(BufferView(t + b, state, capacity, tuple(entries)))
        return views

    def _view_entry(self, group_id: str) -> BufferEntry:
        e = self._entries[group_id]
        return BufferEntry(e.group_id, e.v_traj, e.status)

    def _buffer_of_newest(
        self, status: EntryStatus, deadline: int, counts: tuple[list[int], list[int]] | None = None
    ) -> int:
        """Buffer of the newest entry of a deadline class in the canonical placement.

        Reserved entries fill buffers back to front in descending deadline order, occupied ones
        front to back in ascending order, so the newest entry of class k sits where the running
        fill reaches the number of entries of classes >= k (reserved) or <= k (occupied).
        """
        caps = self._capacities()
        reserved, occupied = counts or self._class_counts()
        reserved_at = self._reserved_per_buffer(caps, reserved)
        k = deadline - self.train_version
        if status is EntryStatus.RESERVED:
            target, filled = sum(reserved[k:]), 0
            for b in range(len(caps) - 1, -1, -1):
                filled += reserved_at[b]
                if filled >= target:
                    return self.train_version + b
        else:
            target, filled = sum(occupied[: k + 1]), 0
            for b in range(len(caps)):
                filled += caps[b] - reserved_at[b]
                if filled >= target:
                    return self.train_version + b
        raise AssertionError("entry outside the canonical placement")

    @staticmethod
    def _reserved_per_buffer(caps: list[int], reserved: list[int]) -> list[int]:
        """How many reserved entries each buffer holds when they are placed as late as possible."""
        at, pool = [0] * len(caps), 0
        for b in range(len(caps) - 1, -1, -1):
            pool += reserved[b]
            at[b] = min(caps[b], pool)
            pool -= at[b]
        return at

    # ------------------------------------------------------------------ transitions

    def reserve(self, group_id: str, v_traj: int) -> Transition:
        self._check_new_group(group_id)
        self._check_version(v_traj)
        deadline = v_traj + self.params.eta
        k = deadline - self.train_version
        counts = self._class_counts()
        if k < 0 or min(self._prefix_slack(counts)[k:]) < 1:
            raise self._not_admissible(v_traj)
        entry = Entry(group_id, v_traj, deadline, EntryStatus.RESERVED, self._next_seq())
        self._entries[group_id] = entry
        self._reserved.setdefault(deadline, {})[group_id] = None
        self._changes = [PutEntry(entry.copy(), new=True)]
        if self.redundant:
            transition = self._finish(Transition("reserve", group_id))
            transition.buffer = self._where(entry)
            return transition
        counts[0][k] += 1
        return self._finish(Transition("reserve", group_id, self._buffer_of_newest(EntryStatus.RESERVED, deadline, counts)))

    def occupy(self, group_id: str) -> Transition:
        entry = self._live(group_id)
        if entry.status is not EntryStatus.RESERVED:
            raise LedgerError(ErrorCode.INVALID_STATUS, f"group {group_id!r} is already occupied")
        self._changes = []
        self._occupy(entry)
        transition = self._finish(Transition("occupy", group_id))
        transition.buffer = self._where(entry)
        return transition

    def complete_member(self, group_id: str, member_id: str) -> Transition:
        """Record one finished member; occupy the group once group_size members are done."""
        entry = self._live(group_id)
        if entry.status is not EntryStatus.RESERVED:
            raise LedgerError(
                ErrorCode.GROUP_COMPLETE,
                f"group {group_id!r} already has its {self.params.group_size} members; cancel {member_id!r}",
            )
        self._changes = []
        if member_id not in entry.completed:
            if len(entry.completed) >= self.params.group_members:
                raise LedgerError(ErrorCode.INVALID_MEMBER, f"group {group_id!r} has no room for member {member_id!r}")
            entry.completed = (*entry.completed, member_id)
            self._changes.append(PutEntry(entry.copy()))
        transition = Transition("complete_member", group_id, completed_members=list(entry.completed))
        if len(entry.completed) >= self.params.group_size:
            self._occupy(entry)
            transition.op = "occupy"
        transition = self._finish(transition)
        transition.buffer = self._where(entry)
        return transition

    def abort(self, group_id: str) -> Transition:
        entry = self._live(group_id)
        self._changes = []
        if group_id in self._sealed:
            self._unseal()  # the pinned batch lost a member; the rest may re-form it
        self._retire(entry, GroupFate.ABORTED)
        return self._finish(Transition("abort", group_id, self.train_version))

    def consume(self, expected: int | None = None) -> Transition:
        """Consume the Ready head buffer. With ``expected`` (the version the caller means to
        consume), a retry after a lost reply is told ``already_consumed`` instead of consuming
        the next buffer: consume is then exactly-once for a retrying trainer."""
        if expected is not None and expected != self.train_version:
            code = ErrorCode.ALREADY_CONSUMED if expected < self.train_version else ErrorCode.NOT_NEXT
            raise LedgerError(code, f"buffer {expected} cannot be consumed: the trainer version is {self.train_version}",
                              version=expected, train_version=self.train_version)
        batch = self._ready_batch()
        if batch is None:
            head = self.buffers()[0]
            raise LedgerError(
                ErrorCode.NOT_READY,
                f"buffer {head.version} is {head.state.value}: {head.occupied} of "
                f"{self.params.batch_size} entries occupied",
                state=head.state.value,
                version=head.version,
                occupied=head.occupied,
            )
        self._changes = []
        version = self.train_version
        if self._sealed:
            self._unseal()
        for g in batch:
            self._retire(self._entries[g], GroupFate.CONSUMED)
        self.train_version += 1
        self._changes.append(SetTrainVersion(self.train_version))
        transition = Transition("consume", buffer=version, consumed=batch)
        # without redundancy a Ready buffer held every entry whose window ended at `version`
        expired = [g for g, e in self._entries.items() if e.deadline < self.train_version]
        for g in expired:
            self._retire(self._entries[g], GroupFate.SURPLUS)
            transition.cancelled.append(g)
        return self._finish(transition)

    # ------------------------------------------------------------------ internals

    def _finish(self, transition: Transition) -> Transition:
        if self.redundant:
            transition.cancelled.extend(self._seal_if_ready())
        transition.changes = self._changes
        self._changes = []
        return transition

    def _ready_batch(self) -> list[str] | None:
        if self._sealed:
            return list(self._sealed)
        B = self.params.batch_size
        caps = self._capacities()
        reserved, occupied = self._class_counts()
        free_at_head = caps[0] - self._reserved_per_buffer(caps, reserved)[0]
        if min(free_at_head, sum(occupied)) < B:
            return None
        return self._earliest_occupied(B)

    def _earliest_occupied(self, n: int) -> list[str]:
        batch: list[str] = []
        for d in sorted(self._occupied):
            for g in self._occupied[d]:
                if len(batch) == n:
                    return batch
                batch.append(g)
        return batch

    def _seal_if_ready(self) -> list[str]:
        """Redundancy: pin buffer t's batch once it is Ready and abort what no longer fits."""
        if self._sealed or self._ready_batch() is None:
            return []
        batch = self._earliest_occupied(self.params.batch_size)
        for g in batch:
            self._discard(self._occupied, self._entries[g].deadline, g)
        self._sealed = batch
        self._changes.append(SetSealed(tuple(batch)))
        cancelled: list[str] = []
        t = self.train_version
        for g, e in list(self._entries.items()):
            if e.deadline == t and g not in batch:  # its only buffer is now full
                self._retire(e, GroupFate.SURPLUS)
                cancelled.append(g)
        slack = self._prefix_slack()
        removed = 0
        for k, s in enumerate(slack):
            excess = -s - removed
            while excess > 0:
                victim = self._surplus_victim(t + k)
                self._retire(self._entries[victim], GroupFate.SURPLUS)
                cancelled.append(victim)
                removed += 1
                excess -= 1
        return cancelled

    def _surplus_victim(self, max_deadline: int) -> str:
        """Newest reservation with deadline <= max_deadline, else the newest occupant."""
        for pool in (self._reserved, self._occupied):
            candidates = [g for d, gs in pool.items() if d <= max_deadline for g in gs]
            if candidates:
                if pool is self._reserved:
                    return max(candidates, key=lambda g: self._entries[g].seq)
                return max(candidates, key=lambda g: self._entries[g].occupied_seq or 0)
        raise AssertionError("ledger over capacity with nothing to abort")

    def _occupy(self, entry: Entry) -> None:
        self._discard(self._reserved, entry.deadline, entry.group_id)
        entry.status = EntryStatus.OCCUPIED
        entry.occupied_seq = self._next_seq()
        self._occupied.setdefault(entry.deadline, {})[entry.group_id] = None
        self._changes.append(PutEntry(entry.copy()))

    def _where(self, entry: Entry) -> int | None:
        """Buffer of an entry that was just reserved or occupied (None if it is gone)."""
        if entry.group_id in self._sealed:
            return self.train_version
        if entry.group_id not in self._entries:
            return None
        return self._buffer_of_newest(entry.status, entry.deadline)

    def _unseal(self) -> None:
        for g in self._sealed:
            e = self._entries[g]
            cls = self._occupied.setdefault(e.deadline, {})
            cls[g] = None
            self._occupied[e.deadline] = dict(sorted(cls.items(), key=lambda kv: self._entries[kv[0]].occupied_seq or 0))
        self._sealed = []
        self._changes.append(SetSealed(()))

    def _retire(self, entry: Entry, fate: GroupFate) -> None:
        g = entry.group_id
        del self._entries[g]
        pool = self._reserved if entry.status is EntryStatus.RESERVED else self._occupied
        self._discard(pool, entry.deadline, g)
        self._retired[g] = fate
        self._retired_at.setdefault(self.train_version, []).append(g)
        self._changes.append(RetireEntry(g, entry.v_traj, fate, self.train_version))

    @staticmethod
    def _discard(pool: dict[int, dict[str, None]], deadline: int, group_id: str) -> None:
        groups = pool[deadline]
        del groups[group_id]
        if not groups:
            del pool[deadline]

    def _live(self, group_id: str) -> Entry:
        entry = self._entries.get(group_id)
        if entry is None:
            fate = self.fate(group_id)
            if fate is not None:
                raise LedgerError(ErrorCode.RETIRED_GROUP, f"group {group_id!r} was already {fate.value}", fate=fate.value)
            raise LedgerError(ErrorCode.UNKNOWN_GROUP, f"group {group_id!r} is not in the ledger")
        return entry

    def _check_new_group(self, group_id: str) -> None:
        if not group_id:
            raise LedgerError(ErrorCode.INVALID_GROUP, "group_id must be a non-empty string")
        if group_id in self._entries:
            raise LedgerError(ErrorCode.DUPLICATE_GROUP, f"group {group_id!r} is already live")
        fate = self.fate(group_id)
        if fate is not None:
            raise LedgerError(ErrorCode.DUPLICATE_GROUP, f"group {group_id!r} was already {fate.value}; ids are single-use")

    def _check_version(self, v_traj: object) -> None:
        if isinstance(v_traj, bool) or not isinstance(v_traj, int):
            raise LedgerError(ErrorCode.INVALID_VERSION, f"v_traj must be an integer, got {v_traj!r}")
        if v_traj < 0:
            raise LedgerError(ErrorCode.INVALID_VERSION, f"v_traj must be >= 0, got {v_traj}")
        if v_traj > self.train_version:
            raise LedgerError(
                ErrorCode.INVALID_VERSION,
                f"v_traj {v_traj} is newer than any model the trainer can have produced "
                f"(train version {self.train_version})",
            )

    def _not_admissible(self, v_traj: int) -> LedgerError:
        t, eta = self.train_version, self.params.eta
        deadline = v_traj + eta
        if deadline < t:
            return LedgerError(
                ErrorCode.NOT_ADMISSIBLE,
                f"v_traj {v_traj} is too stale: with eta={eta} it could train at most version {deadline}, "
                f"and the trainer is at {t}",
            )
        return LedgerError(
            ErrorCode.NOT_ADMISSIBLE,
            f"buffers {t}..{deadline} have no room for another group with v_traj {v_traj} under eta={eta}; "
            "a newer v_traj may still be admissible",
        )

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
