"""The trajectory server's durable state: every trajectory payload for its whole life.

Trajectory states and the transitions allowed between them::

    pending --checkout--> routed --return--> pending        (interrupted: tokens kept)
                          routed --complete--> completed --reward--> rewarded --free--> consumed
    routed --cancel--> cancelling --ack/return--> aborted     (group aborted or already complete)
    pending/completed --cancel--> aborted

Groups: sampled (no V_traj yet) -> reserved (V_traj fixed when its first member is routed)
-> occupied (enough members rewarded) -> consumed; or -> aborted (filtered, surplus).

Reads come from memory; every mutation writes the rows it changed in one transaction before it
returns, so an acknowledged change survives a crash of the process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
from sqlalchemy import Engine, bindparam, delete, insert, select, update

from staleflow.servers import db
from staleflow.servers.schema import ts_groups, ts_meta, ts_trajectories


class TrajState(StrEnum):
    PENDING = "pending"
    ROUTED = "routed"
    COMPLETED = "completed"
    REWARDED = "rewarded"
    CANCELLING = "cancelling"
    ABORTED = "aborted"
    CONSUMED = "consumed"


class GroupState(StrEnum):
    SAMPLED = "sampled"
    RESERVED = "reserved"
    OCCUPIED = "occupied"
    CONSUMED = "consumed"
    ABORTED = "aborted"


LIVE_GROUP_STATES = frozenset({GroupState.SAMPLED, GroupState.RESERVED, GroupState.OCCUPIED})


class StoreConflict(ValueError):
    """A transition that the state machine does not allow."""


@dataclass
class GroupRecord:
    group_id: str
    prompt_index: int
    prompt_text: str
    answer: str
    prompt_ids: tuple[int, ...]
    members: int
    needed: int
    v_traj: int | None
    state: GroupState
    seq: int
    created_at: float
    member_ids: list[str] = field(default_factory=list)


@dataclass
class TrajRecord:
    traj_id: str
    group_id: str
    state: TrajState
    seq: int
    instance_id: str | None = None
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    segments: tuple[tuple[int, int, int], ...] = ()  # (version, start, end)
    finish_reason: str | None = None
    reward: float | None = None
    reward_reason: str | None = None
    updated_at: float = 0.0


def _pack_ints(values: Iterable[int]) -> bytes:
    return np.asarray(list(values), dtype="<i4").tobytes()


def _pack_floats(values: Iterable[float]) -> bytes:
    return np.asarray(list(values), dtype="<f4").tobytes()


def _unpack_ints(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype="<i4").tolist())


def _unpack_floats(blob: bytes) -> tuple[float, ...]:
    return tuple(np.frombuffer(blob, dtype="<f4").tolist())


class TrajectoryStore:
    def __init__(self, engine: Engine):
        self.engine = engine
        db.upgrade(engine)
        self.lock = threading.RLock()
        self.groups: dict[str, GroupRecord] = {}
        self.trajs: dict[str, TrajRecord] = {}
        self.meta: dict[str, str] = {}
        self._seq = 0
        self._load()
        self._update_traj = (
            update(ts_trajectories)
            .where(ts_trajectories.c.traj_id == bindparam("key"))
            .values({c: bindparam(c) for c in ("state", "instance_id", "tokens", "logprobs", "segments",
                                               "finish_reason", "reward", "reward_reason", "updated_at")})
        )
        self._update_group = (
            update(ts_groups).where(ts_groups.c.group_id == bindparam("key"))
            .values(v_traj=bindparam("v_traj"), state=bindparam("state"))
        )

    @classmethod
    def open(cls, url: str, synchronous: str = "NORMAL") -> TrajectoryStore:
        return cls(db.make_engine(url, synchronous))

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ loading

    def _load(self) -> None:
        with self.engine.connect() as conn:
            for r in conn.execute(select(ts_groups).order_by(ts_groups.c.seq)).mappings():
                self.groups[r["group_id"]] = GroupRecord(
                    r["group_id"], r["prompt_index"], r["prompt_text"], r["answer"], _unpack_ints(r["prompt_ids"]),
                    r["members"], r["needed"], r["v_traj"], GroupState(r["state"]), r["seq"], r["created_at"],
                )
                self._seq = max(self._seq, r["seq"])
            for r in conn.execute(select(ts_trajectories).order_by(ts_trajectories.c.seq)).mappings():
                t = TrajRecord(
                    r["traj_id"], r["group_id"], TrajState(r["state"]), r["seq"], r["instance_id"],
                    _unpack_ints(r["tokens"]), _unpack_floats(r["logprobs"]),
                    tuple(tuple(s) for s in json.loads(r["segments"])), r["finish_reason"], r["reward"],
                    r["reward_reason"], r["updated_at"],
                )
                self.trajs[t.traj_id] = t
                self.groups[t.group_id].member_ids.append(t.traj_id)
                self._seq = max(self._seq, t.seq)
            self.meta = {r.key: r.value for r in conn.execute(select(ts_meta))}

    # ------------------------------------------------------------------ persistence

    def _persist(self, new_groups: list[GroupRecord] = (), groups: Iterable[GroupRecord] = (),
                 new_trajs: list[TrajRecord] = (), trajs: Iterable[TrajRecord] = (), meta: dict[str, str] | None = None) -> None:
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
            for key, value in (meta or {}).items():
                conn.execute(delete(ts_meta).where(ts_meta.c.key == key))
                conn.execute(insert(ts_meta).values(key=key, value=value))
        self.meta.update(meta or {})

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
                "updated_at": t.updated_at}

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ sampling

    def live_groups(self) -> int:
        return sum(g.state in LIVE_GROUP_STATES for g in self.groups.values())

    def add_groups(self, prompts: Iterable[tuple[int, str, str, tuple[int, ...]]], members: int, needed: int,
                   next_prompt: int) -> list[GroupRecord]:
        """New groups of ``members`` pending trajectories each, from (index, text, answer, ids)."""
        with self.lock:
            now = time.time()
            new_groups, new_trajs = [], []
            for index, text, answer, ids in prompts:
                group_id = f"g{index}"
                g = GroupRecord(group_id, index, text, answer, tuple(ids), members, needed, None,
                                GroupState.SAMPLED, self._next_seq(), now)
                for m in range(members):
                    t = TrajRecord(f"{group_id}-m{m}", group_id, TrajState.PENDING, self._next_seq())
                    g.member_ids.append(t.traj_id)
                    new_trajs.append(t)
                new_groups.append(g)
            self._persist(new_groups=new_groups, new_trajs=new_trajs, meta={"next_prompt": str(next_prompt)})
            for g in new_groups:
                self.groups[g.group_id] = g
            for t in new_trajs:
                self.trajs[t.traj_id] = t
            return new_groups

    # ------------------------------------------------------------------ routing

    def pending(self) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            return [(t, self.groups[t.group_id]) for t in self.trajs.values() if t.state is TrajState.PENDING]

    def routed(self, instance_id: str | None = None) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            return [(t, self.groups[t.group_id]) for t in self.trajs.values()
                    if t.state in (TrajState.ROUTED, TrajState.CANCELLING)
                    and (instance_id is None or t.instance_id == instance_id)]

    def set_group_version(self, group_id: str, v_traj: int) -> None:
        with self.lock:
            g = self.groups[group_id]
            if g.v_traj is not None and g.v_traj != v_traj:
                raise StoreConflict(f"group {group_id} already has v_traj {g.v_traj}, not {v_traj}")
            if g.state is GroupState.SAMPLED:
                g.v_traj, g.state = v_traj, GroupState.RESERVED
                self._persist(groups=[g])

    def checkout(self, instance_id: str, traj_ids: list[str]) -> list[tuple[TrajRecord, GroupRecord]]:
        """Mark pending trajectories of versioned groups as routed to ``instance_id``."""
        with self.lock:
            out = []
            for traj_id in traj_ids:
                t = self.trajs.get(traj_id)
                if t is None or t.state is not TrajState.PENDING:
                    raise StoreConflict(f"trajectory {traj_id} is not pending")
                if self.groups[t.group_id].v_traj is None:
                    raise StoreConflict(f"trajectory {traj_id}: its group has no v_traj yet")
            for traj_id in traj_ids:
                t = self.trajs[traj_id]
                t.state, t.instance_id = TrajState.ROUTED, instance_id
                out.append((t, self.groups[t.group_id]))
            self._persist(trajs=[t for t, _ in out])
            return out

    def returned(self, partials: list[dict], instance_id: str | None) -> dict[str, str]:
        """Trajectories handed back (interrupt, failed route, dead instance). Returns outcome by id."""
        with self.lock:
            outcome, changed = {}, []
            for p in partials:
                t = self.trajs.get(p["traj_id"])
                if t is None:
                    outcome[p["traj_id"]] = "unknown"
                    continue
                if t.state is TrajState.CANCELLING:
                    t.state, t.instance_id = TrajState.ABORTED, None
                    outcome[t.traj_id] = "aborted"
                elif t.state is TrajState.ROUTED and (instance_id is None or t.instance_id == instance_id):
                    if len(p.get("tokens", ())) >= len(t.tokens):  # never lose generated tokens
                        t.tokens = tuple(p.get("tokens", ()))
                        t.logprobs = tuple(p.get("logprobs", ()))
                        t.segments = tuple((s["version"], s["start"], s["end"]) for s in p.get("segments", ()))
                    t.state, t.instance_id = TrajState.PENDING, None
                    outcome[t.traj_id] = "pending"
                else:
                    outcome[t.traj_id] = f"ignored ({t.state.value})"
                    continue
                changed.append(t)
            if changed:
                self._persist(trajs=changed)
            return outcome

    def release_instance(self, instance_id: str) -> int:
        """A failed instance: its trajectories return to pending with their last known partial
        state and keep their V_traj; cancellations due there are void."""
        with self.lock:
            changed = []
            for t in self.trajs.values():
                if t.instance_id != instance_id:
                    continue
                if t.state is TrajState.ROUTED:
                    t.state, t.instance_id = TrajState.PENDING, None
                    changed.append(t)
                elif t.state is TrajState.CANCELLING:
                    t.state, t.instance_id = TrajState.ABORTED, None
                    changed.append(t)
            if changed:
                self._persist(trajs=changed)
            return len(changed)

    # ------------------------------------------------------------------ completion and rewards

    def completed(self, items: list[dict]) -> list[TrajRecord]:
        """Finished trajectories from instances; redeliveries are ignored. Returns the new ones."""
        with self.lock:
            fresh = []
            for item in items:
                p = item["trajectory"]
                t = self.trajs.get(p["traj_id"])
                if t is None or t.state not in (TrajState.ROUTED, TrajState.CANCELLING, TrajState.PENDING):
                    continue
                group = self.groups[t.group_id]
                t.tokens, t.logprobs = tuple(p["tokens"]), tuple(p["logprobs"])
                t.segments = tuple((s["version"], s["start"], s["end"]) for s in p["segments"])
                t.finish_reason = p.get("finish_reason")
                t.instance_id = item.get("instance_id", t.instance_id)
                if group.state is GroupState.RESERVED and t.state is not TrajState.CANCELLING:
                    t.state = TrajState.COMPLETED
                    fresh.append(t)
                else:  # its group is already complete or aborted: surplus
                    t.state = TrajState.ABORTED
                    fresh.append(t)
            if fresh:
                self._persist(trajs=fresh)
            return [t for t in fresh if t.state is TrajState.COMPLETED]

    def rewarded(self, rewards: dict[str, tuple[float, str]]) -> list[GroupRecord]:
        """Record rewards; returns the groups that now have enough rewarded members."""
        with self.lock:
            changed, ready = [], []
            for traj_id, (reward, reason) in rewards.items():
                t = self.trajs[traj_id]
                if t.state is not TrajState.COMPLETED:
                    continue
                t.reward, t.reward_reason, t.state = reward, reason, TrajState.REWARDED
                changed.append(t)
            self._persist(trajs=changed)
            for g in {self.groups[t.group_id].group_id: self.groups[t.group_id] for t in changed}.values():
                if g.state is GroupState.RESERVED and len(self.group_rewarded(g)) >= g.needed:
                    ready.append(g)
            return ready

    def closable_groups(self) -> list[GroupRecord]:
        """Reserved groups with enough rewarded members: to be occupied (or filtered)."""
        with self.lock:
            return [g for g in self.groups.values()
                    if g.state is GroupState.RESERVED and len(self.group_rewarded(g)) >= g.needed]

    def group_rewarded(self, g: GroupRecord) -> list[TrajRecord]:
        return [self.trajs[m] for m in g.member_ids if self.trajs[m].state is TrajState.REWARDED]

    def close_group(self, group_id: str, state: GroupState) -> list[TrajRecord]:
        """Occupy or abort a group. Members beyond the batch are cancelled; returns those that
        are still on an instance (they must be aborted there)."""
        with self.lock:
            g = self.groups[group_id]
            if g.state not in (GroupState.SAMPLED, GroupState.RESERVED, GroupState.OCCUPIED):
                return []
            keep = set()
            if state is GroupState.OCCUPIED:
                keep = {t.traj_id for t in sorted(self.group_rewarded(g), key=lambda t: t.updated_at)[: g.needed]}
            g.state = state
            changed, on_instances = [], []
            for m in g.member_ids:
                t = self.trajs[m]
                if m in keep or t.state in (TrajState.ABORTED, TrajState.CONSUMED):
                    continue
                if t.state is TrajState.ROUTED:
                    t.state = TrajState.CANCELLING
                    on_instances.append(t)
                elif t.state is not TrajState.CANCELLING:
                    t.state = TrajState.ABORTED
                changed.append(t)
            self._persist(groups=[g], trajs=changed)
            return on_instances

    def cancellations(self) -> list[TrajRecord]:
        with self.lock:
            return [t for t in self.trajs.values() if t.state is TrajState.CANCELLING]

    def cancelled(self, traj_ids: list[str]) -> None:
        with self.lock:
            changed = []
            for traj_id in traj_ids:
                t = self.trajs.get(traj_id)
                if t is not None and t.state is TrajState.CANCELLING:
                    t.state, t.instance_id = TrajState.ABORTED, None
                    changed.append(t)
            if changed:
                self._persist(trajs=changed)

    # ------------------------------------------------------------------ the trainer's side

    def batch(self, group_ids: list[str]) -> list[tuple[TrajRecord, GroupRecord]]:
        with self.lock:
            out = []
            for gid in group_ids:
                g = self.groups.get(gid)
                if g is None:
                    raise StoreConflict(f"group {gid} is unknown to this trajectory server")
                members = [self.trajs[m] for m in g.member_ids
                           if self.trajs[m].state in (TrajState.REWARDED, TrajState.CONSUMED)]
                out.extend((t, g) for t in members[: g.needed])
            return out

    def mark_consumed(self, group_ids: Iterable[str]) -> int:
        """The ledger consumed these groups: they leave the in-flight budget (so new prompts are
        sampled) while their payloads stay until the trainer frees the batch."""
        with self.lock:
            groups = []
            for gid in group_ids:
                g = self.groups.get(gid)
                if g is not None and g.state in LIVE_GROUP_STATES:
                    g.state = GroupState.CONSUMED
                    groups.append(g)
            self._persist(groups=groups, trajs=[])
            return len(groups)

    def free(self, group_ids: list[str]) -> int:
        """The trainer no longer needs the batch: drop its payloads (the groups are consumed)."""
        with self.lock:
            groups, changed = [], []
            for gid in group_ids:
                g = self.groups.get(gid)
                if g is None:
                    continue
                members = [self.trajs[m] for m in g.member_ids if self.trajs[m].state is TrajState.REWARDED]
                if g.state is GroupState.CONSUMED and not members:
                    continue
                g.state = GroupState.CONSUMED
                groups.append(g)
                for t in members:
                    t.state = TrajState.CONSUMED
                    t.tokens, t.logprobs = (), ()
                    changed.append(t)
            self._persist(groups=groups, trajs=changed)
            return len(groups)

    def set_meta(self, key: str, value: str) -> None:
        with self.lock:
            self._persist(meta={key: value})

    # ------------------------------------------------------------------ inspection

    def counts(self) -> dict[str, int]:
        with self.lock:
            counts = {s.value: 0 for s in TrajState}
            for t in self.trajs.values():
                counts[t.state.value] += 1
            return counts
