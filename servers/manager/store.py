"""The durable staleness ledger: the pure ``Ledger`` plus a SQL store.

One writer thread owns the database connection. Callers hand it transitions; it applies each to
the in-memory ledger, writes the changes of everything queued so far in one database transaction
(group commit: concurrent callers share one fsync), and only after that commit does any of those
calls return. If the commit fails, the memory state is rebuilt from the database and every call in
the batch fails, so memory and disk never diverge and nothing half-applied is visible: readers take
the same lock the writer holds from the first apply to the commit.

Only the recently retired groups stay in memory; whether a new group id was retired long ago is
asked of ``ledger_retired`` once per batch, for all the batch's reservations in one query on the
writer's connection, inside the batch's transaction.

On PostgreSQL the writer's session also holds an advisory lock for the ledger's lifetime, so two
managers can never write one ledger: a second one (say, a restarted manager whose predecessor is
not quite dead) waits for the lock, and the server drops a vanished holder's session within
seconds (``db.owner_session`` tightens its keepalives). A writer that lost its connection reconnects and
takes the lock again before it writes; if another manager has it, it refuses every write.

The event log stays the size of the working set: at each consume, the events of groups no longer
live that are more than ``event_retention`` events old leave it (counted by op in
``ledger_event_counts``, so the statistics survive). Consume events stay (they are the run's
consumption record, one per step), and so does ``ledger_retired``, which makes "consumed at most
once" structural.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, bindparam, delete, func, insert, select, update

from staleflow.config.manager import LedgerParams
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.ledger import (
    AdmissionWhatIf,
    BufferView,
    Entry,
    EntryStatus,
    GroupFate,
    Ledger,
    PutEntry,
    RetireEntry,
    SetSealed,
    SetTrainVersion,
    Transition,
)
from staleflow.servers import db
from staleflow.servers.schema import (
    ledger_entries,
    ledger_event_counts,
    ledger_events,
    ledger_retired,
    ledger_retired_counts,
    ledger_settings,
)


class StoreError(StaleFlowError, RuntimeError):
    """The database refused a write; the transition was not applied."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.STORE_UNAVAILABLE, message)


class SettingsMismatch(ValueError):
    """The database was created with other ledger parameters."""


class LedgerInUse(RuntimeError):
    """Another staleness manager holds this ledger's database."""


# the advisory lock a manager holds on PostgreSQL while it owns the ledger (an arbitrary constant)
OWNER_LOCK = 0x4C454447  # "LEDG"


@dataclass
class LedgerStats:
    admitted: int = 0
    occupied: int = 0
    consumed_groups: int = 0
    consumed_buffers: int = 0
    aborted: int = 0
    surplus: int = 0


class DurableLedger:
    max_batch = 512

    def __init__(self, engine: Engine, params: LedgerParams, owner_wait: float = 60.0, event_retention: int = 10_000):
        self.engine = engine
        self.event_retention = event_retention
        # events up to this id were compacted (or are consume events, kept): the next compaction
        # reads only what came after, not the run's every consume event again
        self._compacted_through = 0
        self._lock = threading.Lock()
        db.wait_until_reachable(engine, "the staleness manager's ledger")
        db.upgrade(engine)
        self.params = params
        self._conn: Connection | None = self._connect(wait=owner_wait)  # the writer's session
        self._stale = False  # memory must be reloaded from the database before the next write
        self.ledger = self._load(params)
        self.stats = self._load_stats()
        self._update_entry = (
            update(ledger_entries)
            .where(ledger_entries.c.group_id == bindparam("key"))
            .values({c: bindparam(c) for c in ("v_traj", "deadline", "status", "seq", "occupied_seq", "completed")})
        )
        self._delete_entry = delete(ledger_entries).where(ledger_entries.c.group_id == bindparam("key"))
        self._retired_fates = select(ledger_retired.c.group_id, ledger_retired.c.fate).where(
            ledger_retired.c.group_id.in_(bindparam("ids", expanding=True)))
        # the archived fates of the group ids the batch being applied reserves (None: never retired)
        self._batch_fates: dict[str, GroupFate | None] = {}
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._writer_loop, name="ledger-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(cls, url: str, params: LedgerParams, synchronous: str = "FULL", event_retention: int = 10_000) -> DurableLedger:
        return cls(db.make_engine(url, synchronous), params, event_retention=event_retention)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._writer.join()
            if self._conn is not None:
                self._conn.close()  # ends the session: releases the owner lock on PostgreSQL
            self.engine.dispose()

    def _connect(self, wait: float) -> Connection:
        """The writer's connection; on PostgreSQL, once its session holds the owner lock."""
        try:
            return db.owner_session(self.engine, OWNER_LOCK, wait)
        except db.OwnerLockHeld as exc:
            raise LedgerInUse(f"another staleness manager holds the ledger in {exc}; stop it, "
                              "or point --db at another database") from None

    # ------------------------------------------------------------------ loading

    def _load(self, params: LedgerParams) -> Ledger:
        ledger = self._read(params)
        ledger.archive = self._archived_fate
        return ledger

    def _read(self, params: LedgerParams) -> Ledger:
        assert self._conn is not None
        conn = self._conn
        with conn.begin():
            row = conn.execute(select(ledger_settings).where(ledger_settings.c.id == 1)).mappings().first()
            if row is None:
                conn.execute(
                    insert(ledger_settings).values(
                        id=1,
                        eta=params.eta,
                        batch_size=params.batch_size,
                        batch_redundancy=params.batch_redundancy,
                        group_size=params.group_size,
                        group_redundancy=params.group_redundancy,
                        train_version=0,
                        sealed="[]",
                        created_at=time.time(),
                    )
                )
                return Ledger(params)
            stored = LedgerParams(
                eta=row["eta"],
                batch_size=row["batch_size"],
                batch_redundancy=row["batch_redundancy"],
                group_size=row["group_size"],
                group_redundancy=row["group_redundancy"],
            )
            if stored != params:
                diffs = ", ".join(
                    f"{k}={getattr(stored, k)} (asked {getattr(params, k)})"
                    for k in ("eta", "batch_size", "batch_redundancy", "group_size", "group_redundancy")
                    if getattr(stored, k) != getattr(params, k)
                )
                raise SettingsMismatch(
                    f"this database holds a run created with {diffs}; pass the same settings to resume it, "
                    "or point --db / --state-dir at a new location for a new run"
                )
            entries = [
                Entry(
                    group_id=r["group_id"],
                    v_traj=r["v_traj"],
                    deadline=r["deadline"],
                    status=EntryStatus(r["status"]),
                    seq=r["seq"],
                    occupied_seq=r["occupied_seq"],
                    completed=tuple(json.loads(r["completed"])),
                )
                for r in conn.execute(select(ledger_entries)).mappings()
            ]
            # only the recently retired groups come back into memory: the table answers for the others
            recent = ledger_retired.c.buffer >= row["train_version"] - self.retired_kept_versions(params)
            retired = {r.group_id: GroupFate(r.fate)
                       for r in conn.execute(select(ledger_retired.c.group_id, ledger_retired.c.fate).where(recent))}
            return Ledger.restore(params, row["train_version"], entries, retired, json.loads(row["sealed"]))

    @staticmethod
    def retired_kept_versions(params: LedgerParams) -> int:
        """How many train versions retired groups stay in memory after they retired (the live
        buffers' span and one more), so that a late call about a group that just retired is answered
        from memory; older ones are looked up in ``ledger_retired`` by key."""
        return params.eta + 2

    def _archived_fate(self, group_id: str) -> GroupFate | None:
        if group_id in self._batch_fates:
            return self._batch_fates[group_id]
        with self.engine.connect() as conn:
            fate = conn.execute(select(ledger_retired.c.fate).where(ledger_retired.c.group_id == group_id)).scalar()
        return None if fate is None else GroupFate(fate)

    def _load_stats(self) -> LedgerStats:
        with self.engine.connect() as conn:
            ops = Counter(dict(conn.execute(select(ledger_events.c.op, func.count()).group_by(ledger_events.c.op)).all()))
            ops.update(dict(conn.execute(select(ledger_event_counts.c.op, ledger_event_counts.c.count)).all()))
            fates = dict(conn.execute(select(ledger_retired_counts.c.fate, ledger_retired_counts.c.count)).all())
        return LedgerStats(
            admitted=ops.get("reserve", 0),
            occupied=ops.get("occupy", 0),
            consumed_groups=fates.get(GroupFate.CONSUMED.value, 0),
            consumed_buffers=ops.get("consume", 0),
            aborted=fates.get(GroupFate.ABORTED.value, 0),
            surplus=fates.get(GroupFate.SURPLUS.value, 0),
        )

    # ------------------------------------------------------------------ transitions

    TRANSITIONS = frozenset({"reserve", "occupy", "complete_member", "abort", "consume"})

    def submit(self, name: str, *args: object) -> Future[Transition]:
        """Queue a ledger transition; the future resolves once it is durable (or refused)."""
        if name not in self.TRANSITIONS:
            raise ValueError(f"unknown transition {name!r}")
        future: Future[Transition] = Future()
        if self._closed:
            future.set_exception(StoreError("the ledger is closed"))
            return future
        self._queue.put((name, args, future))
        return future

    def reserve(self, group_id: str, v_traj: int) -> Transition:
        return self.submit("reserve", group_id, v_traj).result()

    def occupy(self, group_id: str) -> Transition:
        return self.submit("occupy", group_id).result()

    def complete_member(self, group_id: str, member_id: str) -> Transition:
        return self.submit("complete_member", group_id, member_id).result()

    def abort(self, group_id: str) -> Transition:
        return self.submit("abort", group_id).result()

    def consume(self) -> Transition:
        return self.submit("consume").result()

    def _writer_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._commit_batch(batch)

    def _ready(self) -> Connection:
        """The writer's connection, reconnected (and the owner lock re-taken) after a loss, with
        memory reloaded from the database after a failed commit."""
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._conn = self._connect(wait=0)  # another manager took over meanwhile: refuse
            self._stale = True
        if self._stale:
            self.ledger = self._load(self.params)  # the database is the source of truth
            self._stale = False
        return self._conn

    def _commit_batch(self, batch: list[tuple[str, tuple, Future]]) -> None:
        with self._lock:
            try:
                conn = self._ready()
            except Exception as exc:  # the database is unreachable, or owned by another manager
                for _, _, future in batch:
                    future.set_exception(StoreError(f"the ledger's database is not usable now: {exc}"))
                return
            done: dict[Future, Transition] = {}
            try:
                with conn.begin():
                    self._batch_fates = self._archived_fates_of_reserved(conn, batch)
                    for name, args, future in batch:
                        try:
                            done[future] = getattr(self.ledger, name)(*args)  # a refused op raises before touching state
                        except Exception as exc:  # a refusal (LedgerError); a bug must not kill the writer either
                            future.set_exception(exc)
                    if done:
                        self._write(conn, list(done.values()))
            except Exception as exc:
                self._stale = True  # memory holds the batch; reload before the next write
                self._compacted_through = 0  # a compaction in the failed transaction did not happen
                try:
                    self.ledger = self._load(self.params)
                    self._stale = False
                except Exception:  # the connection is gone: _ready reconnects and reloads
                    pass
                for name, _, future in batch:
                    if not future.done():
                        op = done[future].op if future in done else name
                        future.set_exception(StoreError(f"could not persist {op}: {exc}"))
                return
            finally:
                self._batch_fates = {}
            if any(t.op == "consume" for t in done.values()):  # their retirements are durable now
                self.ledger.forget_retired(self.ledger.train_version - self.retired_kept_versions(self.params))
            for future, transition in done.items():
                self._count(transition)
                future.set_result(transition)

    def _archived_fates_of_reserved(self, conn: Connection, batch: list[tuple[str, tuple, Future]]) -> dict[str, GroupFate | None]:
        """How each group id the batch reserves left the ledger long ago (None: never), in one
        query: the ledger asks its archive about every new id, and memory holds only recent ones."""
        fates: dict[str, GroupFate | None] = dict.fromkeys(
            args[0] for name, args, _ in batch if name == "reserve" and args and isinstance(args[0], str))
        if fates:
            fates.update((g, GroupFate(fate)) for g, fate in conn.execute(self._retired_fates, {"ids": list(fates)}))
        return fates

    def _write(self, conn: Connection, transitions: list[Transition]) -> None:
        now = time.time()
        inserts, updates, deletes, retired, events = [], [], [], [], []
        settings: dict[str, object] = {}
        for transition in transitions:
            for change in transition.changes:
                if isinstance(change, PutEntry):
                    e = change.entry
                    row = {
                        "v_traj": e.v_traj,
                        "deadline": e.deadline,
                        "status": e.status.value,
                        "seq": e.seq,
                        "occupied_seq": e.occupied_seq,
                        "completed": json.dumps(list(e.completed)),
                    }
                    if change.new:
                        inserts.append({"group_id": e.group_id, **row})
                    else:
                        self._flush(conn, inserts)  # an update may touch a row inserted in this batch
                        updates.append({"key": e.group_id, **row})
                elif isinstance(change, RetireEntry):
                    # deleted after the batch's inserts and updates: a retired id never comes back
                    deletes.append({"key": change.group_id})
                    retired.append(
                        {"group_id": change.group_id, "v_traj": change.v_traj, "fate": change.fate.value,
                         "buffer": change.buffer, "retired_at": now}
                    )
                elif isinstance(change, SetTrainVersion):
                    settings["train_version"] = change.train_version
                elif isinstance(change, SetSealed):
                    settings["sealed"] = json.dumps(list(change.group_ids))
            detail: dict[str, object] = {"cancelled": transition.cancelled}
            if transition.consumed is not None:
                detail["consumed"] = transition.consumed
            events.append(
                {"at": now, "op": transition.op, "group_id": transition.group_id, "buffer": transition.buffer,
                 "detail": json.dumps(detail)}
            )
        self._flush(conn, inserts, updates)
        if deletes:
            conn.execute(self._delete_entry, deletes)
        if retired:
            conn.execute(insert(ledger_retired), retired)
            _add_counts(conn, ledger_retired_counts, ledger_retired_counts.c.fate, Counter(r["fate"] for r in retired))
        conn.execute(insert(ledger_events), events)
        if settings:
            conn.execute(update(ledger_settings).where(ledger_settings.c.id == 1).values(**settings))
        if self.event_retention and any(t.op == "consume" for t in transitions):
            self._compact_events(conn)

    def _compact_events(self, conn: Connection) -> None:
        """Events of groups no longer live, older than the retention window, leave the log; their
        counts by op are kept. Consume events stay."""
        newest = conn.execute(select(func.max(ledger_events.c.id))).scalar_one() or 0
        through = newest - self.event_retention
        if through <= self._compacted_through:
            return
        window = ((ledger_events.c.id > self._compacted_through) & (ledger_events.c.id <= through)
                  & (ledger_events.c.op != "consume"))
        old = window & ledger_events.c.group_id.not_in(select(ledger_entries.c.group_id))
        counts = dict(conn.execute(select(ledger_events.c.op, func.count()).where(old).group_by(ledger_events.c.op)).all())
        if counts:
            _add_counts(conn, ledger_event_counts, ledger_event_counts.c.op, counts)
            conn.execute(delete(ledger_events).where(old))
        # the events of a group still live stay, and the next compaction starts at the first of them
        held = conn.execute(select(func.min(ledger_events.c.id))
                            .where(window & ledger_events.c.group_id.in_(select(ledger_entries.c.group_id)))).scalar()
        self._compacted_through = through if held is None else held - 1

    def _flush(self, conn: Connection, inserts: list[dict], updates: list[dict] | None = None) -> None:
        if inserts:
            conn.execute(insert(ledger_entries), inserts)
            inserts.clear()
        if updates:
            conn.execute(self._update_entry, updates)
            updates.clear()

    def _count(self, transition: Transition) -> None:
        s = self.stats
        if transition.op == "reserve":
            s.admitted += 1
        elif transition.op == "occupy":
            s.occupied += 1
        elif transition.op == "consume":
            s.consumed_buffers += 1
            s.consumed_groups += len(transition.consumed or [])
        fates = Counter(c.fate for c in transition.changes if isinstance(c, RetireEntry))
        s.aborted += fates[GroupFate.ABORTED]
        s.surplus += fates[GroupFate.SURPLUS]

    # ------------------------------------------------------------------ queries

    def buffers(self) -> list[BufferView]:
        with self._lock:
            return self.ledger.buffers()

    def admission(self, versions: list[int] | None = None) -> dict[int, int]:
        with self._lock:
            return self.ledger.admission(versions)

    def what_if(self, version: int, count: int) -> AdmissionWhatIf:
        with self._lock:
            return self.ledger.what_if(version, count)

    def snapshot(self) -> tuple[int, list[BufferView], dict[str, int]]:
        with self._lock:
            return self.ledger.train_version, self.ledger.buffers(), self.ledger.counts()

    def entry(self, group_id: str) -> Entry | None:
        with self._lock:
            return self.ledger.entry(group_id)

    def fate(self, group_id: str) -> GroupFate | None:
        with self._lock:
            return self.ledger.fate(group_id)

    @property
    def train_version(self) -> int:
        return self.ledger.train_version

    def events(self, after: int = 0, limit: int = 100) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(ledger_events).where(ledger_events.c.id > after).order_by(ledger_events.c.id).limit(limit)
            ).mappings()
            return [{**dict(r), "detail": json.loads(r["detail"])} for r in rows]

    def consumed_batch(self, version: int) -> list[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(ledger_retired.c.group_id)
                .where(ledger_retired.c.buffer == version, ledger_retired.c.fate == GroupFate.CONSUMED.value)
                .order_by(ledger_retired.c.group_id)
            )
            return [r.group_id for r in rows]


def _add_counts(conn: Connection, table, key, counts: Mapping[str, int]) -> None:
    """Add ``counts`` to the (key, count) rows of ``table``."""
    kept = dict(conn.execute(select(key, table.c.count).where(key.in_(list(counts)))).all())
    for name, n in counts.items():
        if name in kept:
            conn.execute(update(table).where(key == name).values(count=kept[name] + n))
        else:
            conn.execute(insert(table).values({key.name: name, "count": n}))


def consumption_record(url: str) -> tuple[list[str], list[tuple[str, int, int]]]:
    """A ledger database's own record of what was consumed, read without opening the ledger (a
    closed run's audit): group ids in the order consume events took them, and (group id, V_traj,
    buffer) of every group retired as consumed."""
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            consumed: list[str] = []
            for (detail,) in conn.execute(select(ledger_events.c.detail).where(ledger_events.c.op == "consume")
                                          .order_by(ledger_events.c.id)):
                consumed += json.loads(detail).get("consumed") or []
            fates = [tuple(r) for r in conn.execute(
                select(ledger_retired.c.group_id, ledger_retired.c.v_traj, ledger_retired.c.buffer)
                .where(ledger_retired.c.fate == GroupFate.CONSUMED.value))]
    finally:
        engine.dispose()
    return consumed, fates
