"""The trajectory server's durable state: the payload of every trajectory in the working set.

The states and their transitions are the pure ``TrajectoryBook`` (``staleflow.trajectory_book``);
this store keeps one in memory, reads come from it, and every transition writes the rows it changed
in one transaction before it returns, so an acknowledged change survives a crash of the process.

A write the database refuses (a lost connection, a server restart) fails with ``StoreUnavailable``
and memory is reloaded from the database, so a refused change never lingers in memory; while the
database cannot be read back, every call fails the same way until it can. On PostgreSQL the store
holds an advisory lock for its lifetime, so a second trajectory server on the same database waits
for the first to be gone (or refuses to start) instead of writing beside it.

A group done for good (freed by the trainer, or aborted, with every member consumed or aborted)
leaves the live tables and memory in the same transaction as the change that finished it: it is
moved to the append-only archive tables (``retention="archive"``) or deleted (``"drop"``). So the
live store, memory, the reload at start-up and every poll cost what is in flight, not the run's
history.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from sqlalchemy import Engine, bindparam, delete, func, insert, select, update

from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.length_skew import StepSkew, TrajectoryFate
from staleflow.servers import db
from staleflow.servers.schema import (
    ts_finished_lengths,
    ts_groups,
    ts_groups_archive,
    ts_meta,
    ts_progress,
    ts_trajectories,
    ts_trajectories_archive,
)
from staleflow.trajectory_book import (
    LIVE_GROUP_STATES,
    UNLIMITED,
    Generated,
    GroupRecord,
    GroupState,
    ProgressCheckpoint,
    SegmentLimits,
    StoreConflict,
    TrajectoryBook,
    TrajRecord,
    TrajState,
)

REGENERATED_META = "regenerated_tokens"
"""The meta key of ``TrajectoryBook.regenerated``: "trajectories,tokens"."""

LENGTHS_EPOCH_META = "finished_lengths_epoch"
"""The meta key of the finished-lengths feed's epoch: made once per database, so a follower's
cursor from another database (a store started afresh) is told apart from one into this one."""


class StoreUnavailable(StaleFlowError):
    """The database refused a change; it was not applied (memory holds the database's state)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.STORE_UNAVAILABLE, message)


class _FreshLock:
    """The store's re-entrant lock; taking it first reloads memory if a failed write left it
    ahead of the database."""

    def __init__(self, store: TrajectoryStore):
        self._lock = threading.RLock()
        self._store = store

    def __enter__(self) -> _FreshLock:
        self._lock.acquire()
        try:
            self._store._ensure_fresh()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @property
    def unchecked(self) -> threading.RLock:
        """The lock alone, without the reload."""
        return self._lock


class TrajectoryStoreInUse(RuntimeError):
    """Another trajectory server holds this store's database."""


# the advisory lock a trajectory server holds on PostgreSQL while it owns the store
OWNER_LOCK = 0x54524A53  # "TRJS"


__all__ = ["LIVE_GROUP_STATES", "GroupRecord", "GroupState", "StoreConflict", "StoreUnavailable", "TrajRecord", "TrajState",
           "TrajectoryStore", "TrajectoryStoreInUse"]


def _pack_ints(values: Iterable[int]) -> bytes:
    return np.asarray(list(values), dtype="<i4").tobytes()


def _pack_floats(values: Iterable[float]) -> bytes:
    return np.asarray(list(values), dtype="<f4").tobytes()


def _unpack_ints(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype="<i4").tolist())


def _unpack_floats(blob: bytes) -> tuple[float, ...]:
    return tuple(np.frombuffer(blob, dtype="<f4").tolist())


class TrajectoryStore:
    def __init__(self, engine: Engine, owner_wait: float = 60.0, retention: str = "archive",
                 lengths_kept: int = 10_000):
        if retention not in ("archive", "drop"):
            raise ValueError(f"retention must be 'archive' or 'drop', not {retention!r}")
        if lengths_kept < 1:
            raise ValueError(f"lengths_kept must be >= 1, got {lengths_kept}")
        self.engine = engine
        self.retention = retention
        self.lengths_kept = lengths_kept
        db.wait_until_reachable(engine, "the trajectory store")
        db.upgrade(engine)
        try:
            self._owner = db.owner_session(engine, OWNER_LOCK, owner_wait)
        except db.OwnerLockHeld as exc:
            raise TrajectoryStoreInUse(f"another trajectory server holds the store in {exc}; stop it, "
                                       "or point db_url at another database") from None
        self.lock = _FreshLock(self)
        self._stale = False
        self.unavailable: str | None = None  # why the database failed last (a write, a reload); None once it answers
        self._checkpointed: set[str] = set()  # trajectories with rows in ts_progress
        self.failed_over = [0, 0]  # trajectories released from failed instances, the response tokens they kept
        self._use(TrajectoryBook())
        self.meta: dict[str, str] = {}
        self._load()
        self._update_traj = (
            update(ts_trajectories)
            .where(ts_trajectories.c.traj_id == bindparam("key"))
            .values({c: bindparam(c) for c in ("state", "instance_id", "tokens", "logprobs", "segments",
                                               "finish_reason", "reward", "reward_reason", "updated_at", "carried")})
        )
        self._update_group = (
            update(ts_groups).where(ts_groups.c.group_id == bindparam("key"))
            .values(v_traj=bindparam("v_traj"), state=bindparam("state"))
        )
        if LENGTHS_EPOCH_META not in self.meta:
            self.set_meta(LENGTHS_EPOCH_META, uuid.uuid4().hex)

    @classmethod
    def open(cls, url: str, synchronous: str = "NORMAL", retention: str = "archive",
             lengths_kept: int = 10_000) -> TrajectoryStore:
        return cls(db.make_engine(url, synchronous), retention=retention, lengths_kept=lengths_kept)

    def _use(self, book: TrajectoryBook) -> None:
        self.book = book
        self.groups = book.groups  # read-only views for the endpoints
        self.trajs = book.trajs

    def close(self) -> None:
        self._owner.close()  # ends the owner's session: releases the lock on PostgreSQL
        self.engine.dispose()

    # ------------------------------------------------------------------ loading

    def _ensure_fresh(self) -> None:
        if not self._stale:
            return
        book, meta = self.book, self.meta
        self._use(TrajectoryBook())
        self.book.skew = book.skew  # the accounting since this server started goes on
        try:
            self._load()
        except Exception as exc:
            self._use(book)
            self.meta = meta
            self.unavailable = f"cannot be read: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
            raise StoreUnavailable(f"the trajectory store's database cannot be read: {exc}") from exc
        self._stale = False
        self.unavailable = None

    def _load(self) -> None:
        with self.engine.connect() as conn:
            groups = [_group_record(r) for r in conn.execute(select(ts_groups).order_by(ts_groups.c.seq)).mappings()]
            trajs = [_traj_record(r) for r in conn.execute(select(ts_trajectories).order_by(ts_trajectories.c.seq)).mappings()]
            self.book.restore(groups, trajs)
            self._checkpointed = set()
            for r in conn.execute(select(ts_progress).order_by(ts_progress.c.id)).mappings():
                self._checkpointed.add(r["traj_id"])
                self.book.adopt(ProgressCheckpoint(r["traj_id"], r["instance_id"], r["start"], _unpack_ints(r["tokens"]),
                                           _unpack_floats(r["logprobs"]),
                                           tuple(tuple(s) for s in json.loads(r["segments"]))))
            self.meta = {r.key: r.value for r in conn.execute(select(ts_meta))}
        if REGENERATED_META in self.meta:  # the count goes on across restarts of this server
            self.book.regenerated = [int(n) for n in self.meta[REGENERATED_META].split(",")]

    # ------------------------------------------------------------------ persistence

    def _persist(self, new_groups: Sequence[GroupRecord] = (), groups: Iterable[GroupRecord] = (),
                 new_trajs: Sequence[TrajRecord] = (), trajs: Iterable[TrajRecord] = (), meta: dict[str, str] | None = None,
                 lengths: Sequence[TrajRecord] = ()) -> None:
        groups, trajs = list(groups), list(trajs)
        finished = self.book.finished([g.group_id for g in groups] + [t.group_id for t in trajs])
        try:
            self._write(new_groups, groups, new_trajs, trajs, meta, finished, lengths)
        except Exception as exc:
            self._stale = True  # memory already holds the change: reload it from the database
            self.unavailable = f"refused a write: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
            try:
                self._ensure_fresh()
            except StoreUnavailable:
                pass  # the next call reloads (or fails the same way)
            raise StoreUnavailable(f"could not persist the change: {exc}") from exc
        self.book.forget(finished)
        self.meta.update(meta or {})

    def _write(self, new_groups: Sequence[GroupRecord], groups: Iterable[GroupRecord], new_trajs: Sequence[TrajRecord],
               trajs: Iterable[TrajRecord], meta: dict[str, str] | None, finished: list[GroupRecord],
               lengths: Sequence[TrajRecord] = ()) -> None:
        now = time.time()
        traj_rows = []
        for t in trajs:
            t.updated_at = now
            traj_rows.append({"key": t.traj_id, **self._traj_values(t)})
        with self.engine.begin() as conn:
            if new_groups:
                conn.execute(insert(ts_groups), [self._group_row(g) for g in new_groups])
            if new_trajs:
                for t in new_trajs:
                    t.updated_at = now
                conn.execute(insert(ts_trajectories), [{"traj_id": t.traj_id, "group_id": t.group_id, "seq": t.seq,
                                                        **self._traj_values(t)} for t in new_trajs])
            group_rows = [{"key": g.group_id, "v_traj": g.v_traj, "state": g.state.value} for g in groups]
            if group_rows:
                conn.execute(self._update_group, group_rows)
            if traj_rows:
                conn.execute(self._update_traj, traj_rows)
                self._fold_checkpoints(conn, [row["key"] for row in traj_rows])
            for key, value in (meta or {}).items():
                conn.execute(delete(ts_meta).where(ts_meta.c.key == key))
                conn.execute(insert(ts_meta).values(key=key, value=value))
            if lengths:
                self._append_lengths(conn, lengths, now)
            if finished:
                self._retire(conn, finished, now)

    def _append_lengths(self, conn, completed: Sequence[TrajRecord], now: float) -> None:
        """The finished lengths of newly completed trajectories join the feed; the oldest beyond
        the newest ``lengths_kept`` leave it."""
        conn.execute(insert(ts_finished_lengths), [
            {"traj_id": t.traj_id, "group_id": t.group_id, "prompt_key": prompt_key(self.book.groups[t.group_id]),
             "length": len(t.tokens), "at": now} for t in completed])
        newest = conn.execute(select(func.max(ts_finished_lengths.c.id))).scalar_one()
        conn.execute(delete(ts_finished_lengths).where(ts_finished_lengths.c.id <= newest - self.lengths_kept))

    def _retire(self, conn, finished: list[GroupRecord], now: float) -> None:
        """Finished groups and their members leave the live tables (archived or dropped)."""
        group_ids = [g.group_id for g in finished]
        if self.retention == "archive":
            conn.execute(insert(ts_groups_archive), [{**self._group_row(g), "archived_at": now} for g in finished])
            conn.execute(insert(ts_trajectories_archive), [
                {"traj_id": t.traj_id, "group_id": t.group_id, "seq": t.seq, **self._traj_values(t), "archived_at": now}
                for t in (self.book.trajs[m] for g in finished for m in g.member_ids)])
        conn.execute(delete(ts_trajectories).where(ts_trajectories.c.group_id.in_(group_ids)))
        conn.execute(delete(ts_groups).where(ts_groups.c.group_id.in_(group_ids)))

    def _fold_checkpoints(self, conn, traj_ids: list[str]) -> None:
        """The trajectories' rows now hold their whole response: their checkpoint rows go."""
        folded = [t for t in traj_ids if t in self._checkpointed]
        for start in range(0, len(folded), 1000):
            conn.execute(delete(ts_progress).where(ts_progress.c.traj_id.in_(folded[start:start + 1000])))
        self._checkpointed.difference_update(folded)

    @staticmethod
    def _group_row(g: GroupRecord) -> dict:
        return {"group_id": g.group_id, "prompt_index": g.prompt_index, "prompt_text": g.prompt_text,
                "answer": g.answer, "prompt_ids": _pack_ints(g.prompt_ids), "members": g.members,
                "needed": g.needed, "v_traj": g.v_traj, "state": g.state.value, "seq": g.seq,
                "created_at": g.created_at}

    @staticmethod
    def _traj_values(t: TrajRecord) -> dict:
        return {"state": t.state.value, "instance_id": t.instance_id, "tokens": _pack_ints(t.tokens),
                "logprobs": _pack_floats(t.logprobs), "segments": json.dumps([list(s) for s in t.segments]),
                "finish_reason": t.finish_reason, "reward": t.reward, "reward_reason": t.reward_reason,
                "updated_at": t.updated_at, "carried": json.dumps(t.carried) if t.carried else None}

    # ------------------------------------------------------------------ the transitions, persisted

    def live_groups(self) -> int:
        return self.book.live_groups()

    def add_groups(self, prompts: Iterable[tuple[int, str, str, tuple[int, ...]]], members: int, needed: int,
                   next_prompt: int) -> list[GroupRecord]:
        """New groups of ``members`` pending trajectories each, from (index, text, answer, ids)."""
        with self.lock:
            groups, trajs = self.book.new_groups(prompts, members, needed, time.time())
            self._persist(new_groups=groups, new_trajs=trajs, meta={"next_prompt": str(next_prompt)})
            self.book.add(groups, trajs)
            return groups

    def pending(self) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            return self.book.pending()

    def routed(self, instance_id: str | None = None) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            return self.book.routed(instance_id)

    def reservations_needed(self, assignments: Iterable[tuple[str, int]]) -> dict[str, int]:
        """The groups to reserve in the ledger before ``assignments`` are checked out
        (``TrajectoryBook.reservations_needed``)."""
        return self.book.reservations_needed(assignments)

    def grant(self, assignments: Iterable[tuple[str, int]], not_reserved: dict[str, str]
              ) -> tuple[list[str], list[tuple[str, str]]]:
        """Which assignments may be checked out (``TrajectoryBook.grant``)."""
        return self.book.grant(assignments, not_reserved)

    @property
    def regenerated(self) -> tuple[int, int]:
        """Trajectories regenerated after a failover, and their response tokens lost."""
        trajectories, tokens = self.book.regenerated
        return trajectories, tokens

    def listed(self, state: TrajState | None = None) -> list[tuple[TrajRecord, GroupRecord]]:
        """The live trajectories (in ``state``, or all) with their groups."""
        with self.lock:
            return [(t, self.groups[t.group_id]) for t in self.trajs.values() if state is None or t.state is state]

    def trajectory(self, traj_id: str) -> tuple[TrajRecord, GroupRecord, int | None] | None:
        """A trajectory, its group and the response tokens its instance last said it holds; one
        done for good is read back from the archive (held nowhere). None: unknown."""
        with self.lock:
            t = self.trajs.get(traj_id)
            if t is not None:
                return t, self.groups[t.group_id], self.book.held_on_instance(traj_id)
        archived = self.archived_trajectory(traj_id)
        return None if archived is None else (*archived, None)

    def set_group_version(self, group_id: str, v_traj: int) -> None:
        with self.lock:
            changed = self.book.set_group_version(group_id, v_traj, time.time())
            if changed:
                self._persist(groups=changed)

    def checkout(self, instance_id: str, traj_ids: list[str]) -> list[tuple[TrajRecord, GroupRecord]]:
        """Mark pending trajectories of versioned groups as routed to ``instance_id``."""
        with self.lock:
            routed = self.book.checkout(instance_id, traj_ids)
            self._persist(trajs=routed)
            return [(t, self.groups[t.group_id]) for t in routed]

    def returned(self, partials: list[Generated], instance_id: str | None,
                 limits: SegmentLimits = UNLIMITED) -> dict[str, str]:
        """Trajectories handed back (interrupt, failed route, dead instance). Returns outcome by id."""
        with self.lock:
            regenerated = list(self.book.regenerated)
            outcome, changed = self.book.returned(partials, instance_id, limits)
            if changed:
                self._persist(trajs=changed, meta=self._regenerated_meta(regenerated))
            return outcome

    def _regenerated_meta(self, before: list[int]) -> dict[str, str] | None:
        """The regenerated-token count to store with a change that moved it."""
        after = self.book.regenerated
        return {REGENERATED_META: f"{after[0]},{after[1]}"} if after != before else None

    def checkpoint(self, checkpoints: list[ProgressCheckpoint], instance_id: str | None = None,
                   on_instance: dict[str, int] | None = None, limits: SegmentLimits = UNLIMITED) -> dict[str, int]:
        """Progress of running trajectories, appended durably as checkpoint rows (the trajectory's
        own row is not rewritten). Returns the response length held of each one that counted.
        ``on_instance``: what ``instance_id`` holds of each of its trajectories now (kept in memory:
        it only counts the tokens a failure of the instance makes them generate again)."""
        with self.lock:
            if instance_id is not None and on_instance:
                self.book.holding(instance_id, on_instance)
            held, appended = self.book.checkpoint(checkpoints, limits)
            if appended:
                now = time.time()
                try:
                    with self.engine.begin() as conn:
                        conn.execute(insert(ts_progress), [
                            {"traj_id": c.traj_id, "instance_id": c.instance_id, "start": c.start,
                             "tokens": _pack_ints(c.tokens), "logprobs": _pack_floats(c.logprobs),
                             "segments": json.dumps([list(s) for s in c.segments]), "at": now} for c in appended])
                except Exception as exc:
                    self._stale = True  # memory already holds the checkpoints: the next call reloads it
                    raise StoreUnavailable(f"could not persist the checkpoints: {exc}") from exc
                self._checkpointed.update(c.traj_id for c in appended)
            return held

    def release_instance(self, instance_id: str, generated: Mapping[str, int] | None = None) -> int:
        """A failed instance: its trajectories return to pending (see ``TrajectoryBook``)."""
        with self.lock:
            regenerated = list(self.book.regenerated)
            changed = self.book.release_instance(instance_id, generated)
            if changed:
                self._persist(trajs=changed, meta=self._regenerated_meta(regenerated))
            resumed = [t for t in changed if t.state is TrajState.PENDING]
            self.failed_over[0] += len(resumed)
            self.failed_over[1] += sum(len(t.tokens) for t in resumed)
            return len(changed)

    def completed(self, finished: list[Generated], limits: SegmentLimits = UNLIMITED) -> list[TrajRecord]:
        """Finished trajectories from instances; redeliveries are ignored. Returns the new ones."""
        with self.lock:
            changed = self.book.completed(finished, limits)
            fresh = [t for t in changed if t.state is TrajState.COMPLETED]
            if changed:
                self._persist(trajs=changed, lengths=fresh)
            return fresh

    def rewarded(self, rewards: dict[str, tuple[float, str]]) -> list[GroupRecord]:
        """Record rewards; returns the groups that now have enough rewarded members."""
        with self.lock:
            changed, ready = self.book.rewarded(rewards)
            self._persist(trajs=changed)
            return ready

    def closable_groups(self) -> list[GroupRecord]:
        with self.lock:
            return self.book.closable_groups()

    def group_rewarded(self, g: GroupRecord) -> list[TrajRecord]:
        return self.book.group_rewarded(g)

    def close_group(self, group_id: str, state: GroupState, fate: TrajectoryFate | None = None) -> list[TrajRecord]:
        """Occupy or abort a group; returns its members still on an instance (to be aborted there)."""
        with self.lock:
            groups, changed, on_instances = self.book.close_group(group_id, state, fate)
            if groups:
                self._persist(groups=groups, trajs=changed)
            return on_instances

    def cancellations(self) -> list[TrajRecord]:
        with self.lock:
            return self.book.cancellations()

    def cancelled(self, traj_ids: list[str]) -> None:
        with self.lock:
            changed = self.book.cancelled(traj_ids)
            if changed:
                self._persist(trajs=changed)

    def batch(self, group_ids: list[str]) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            try:
                return self.book.batch(group_ids)
            except StoreConflict as exc:
                gone = [gid for gid in group_ids if gid not in self.groups]
                if exc.code is ErrorCode.UNKNOWN_GROUP and gone and self.archived(gone[0]):
                    raise StoreConflict(f"group {gone[0]} was freed and archived: its batch's payloads are gone",
                                        ErrorCode.BATCH_FREED) from None
                raise

    def archived(self, group_id: str) -> bool:
        """The group left the live store into the archive."""
        with self.engine.connect() as conn:
            return conn.execute(select(ts_groups_archive.c.group_id)
                                .where(ts_groups_archive.c.group_id == group_id)).first() is not None

    def archived_trajectory(self, traj_id: str) -> tuple[TrajRecord, GroupRecord] | None:
        """A trajectory that left the live store, and its group, as archived (inspection)."""
        with self.engine.connect() as conn:
            t = conn.execute(select(ts_trajectories_archive)
                             .where(ts_trajectories_archive.c.traj_id == traj_id)).mappings().first()
            g = t and conn.execute(select(ts_groups_archive)
                                   .where(ts_groups_archive.c.group_id == t["group_id"])).mappings().first()
        return (_traj_record(t), _group_record(g)) if t and g else None

    def archived_count(self) -> int:
        """Trajectories in the archive (read from the database: it is not held in memory)."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(ts_trajectories_archive)).scalar_one()

    def mark_consumed(self, group_ids: Iterable[str], buffer: int | None = None) -> int:
        """The ledger consumed these groups (see ``TrajectoryBook.mark_consumed``)."""
        with self.lock:
            groups = self.book.mark_consumed(group_ids, buffer)
            self._persist(groups=groups, trajs=[])
            return len(groups)

    def follow_ledger(self, op: str, group_id: str | None, consumed: Iterable[str], cancelled: Iterable[str],
                      cancelled_fate: TrajectoryFate, buffer: int | None = None) -> list[TrajRecord]:
        """A ledger transition (see ``TrajectoryBook.follow_ledger``); returns the members still
        on an instance (to be aborted there)."""
        with self.lock:
            groups, changed, on_instances = self.book.follow_ledger(op, group_id, consumed, cancelled, cancelled_fate,
                                                                    buffer)
            if groups or changed:
                self._persist(groups=groups, trajs=changed)
            return on_instances

    def free(self, group_ids: list[str], buffer: int | None = None) -> int:
        """The trainer no longer needs the batch: drop its payloads (the groups are consumed)."""
        with self.lock:
            groups, changed = self.book.free(group_ids, buffer)
            self._persist(groups=groups, trajs=changed)
            return len(groups)

    def set_meta(self, key: str, value: str) -> None:
        with self.lock:
            self._persist(meta={key: value})

    # ------------------------------------------------------------------ inspection

    def counts(self) -> dict[str, int]:
        with self.lock:
            return self.book.counts()

    def counts_in_memory(self) -> dict[str, int]:
        """``counts`` without reloading a stale memory first: touches no database (health), so it
        answers while the database is down (memory may then hold a change the database refused)."""
        with self.lock.unchecked:
            return self.book.counts()

    def completed_ones(self) -> list[TrajRecord]:
        with self.lock:
            return self.book.completed_ones()

    def length_skew_totals(self) -> tuple[StepSkew, Counter[int]]:
        """The length-skew accounting's totals and what is in flight, by bucket. From memory
        without a reload (the accounting is this server's own and survives one): health reads it,
        and must answer while the database is down."""
        with self.lock.unchecked:
            return self.book.skew.totals(), self.book.skew.in_flight()

    def finished_lengths(self, after: int, limit: int) -> dict:
        """The feed of finished lengths after id ``after`` (at most ``limit``, oldest first), read
        from the database; ``skipped``: those after ``after`` already pruned (the follower fell
        more than ``lengths_kept`` behind, or started afresh)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(ts_finished_lengths).where(ts_finished_lengths.c.id > after)
                                .order_by(ts_finished_lengths.c.id).limit(limit)).mappings().all()
        lengths = [{"id": r["id"], "traj_id": r["traj_id"], "group_id": r["group_id"], "prompt_key": r["prompt_key"],
                    "length": r["length"]} for r in rows]
        return {"epoch": self.meta[LENGTHS_EPOCH_META], "lengths": lengths,
                "next": lengths[-1]["id"] if lengths else after,
                "skipped": max(0, lengths[0]["id"] - after - 1) if lengths else 0}

    def length_skew(self, after_step: int = -1) -> dict:
        """What the bound did to the response lengths since this server started (``LengthSkew``)."""
        with self.lock:
            return self.book.skew.to_json(after_step)


@functools.lru_cache(maxsize=65_536)
def _text_key(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def prompt_key(g: GroupRecord) -> str:
    """What tells one prompt from another across groups (the same text sampled again, a cycled
    dataset's row): a short hash of its text."""
    return _text_key(g.prompt_text)


def _group_record(r) -> GroupRecord:
    return GroupRecord(r["group_id"], r["prompt_index"], r["prompt_text"], r["answer"], _unpack_ints(r["prompt_ids"]),
                       r["members"], r["needed"], r["v_traj"], GroupState(r["state"]), r["seq"], r["created_at"])


def _traj_record(r) -> TrajRecord:
    return TrajRecord(r["traj_id"], r["group_id"], TrajState(r["state"]), r["seq"], r["instance_id"],
                      _unpack_ints(r["tokens"]), _unpack_floats(r["logprobs"]),
                      tuple(tuple(s) for s in json.loads(r["segments"])), r["finish_reason"], r["reward"],
                      r["reward_reason"], r["updated_at"], json.loads(r["carried"]) if r["carried"] else None)
