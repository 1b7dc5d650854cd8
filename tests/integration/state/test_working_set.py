"""The working set stays bounded: finished trajectory groups leave the live store (archived or
dropped) and the ledger's event log is compacted, on SQLite and PostgreSQL, across restarts, and
nothing that is still needed leaves with them."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from sqlalchemy import event, func, select, text

from staleflow.errors import ErrorCode
from staleflow.ledger import GroupFate, LedgerError, LedgerParams
from staleflow.servers import db
from staleflow.servers.manager.store import DurableLedger, consumption_record
from staleflow.servers.schema import (
    ledger_event_counts,
    ledger_events,
    ts_groups,
    ts_groups_archive,
    ts_trajectories,
    ts_trajectories_archive,
)
from staleflow.servers.trajectories.store import (
    GroupState,
    StoreConflict,
    StoreUnavailable,
    TrajectoryStore,
    TrajState,
)
from staleflow.trajectory_book import Generated

BATCH, MEMBERS, NEEDED = 2, 3, 2  # one spare member per group: it is cancelled when the group closes


@pytest.fixture
def url(tmp_path: Path, db_url: str | None) -> str:
    return db_url or db.sqlite_url(tmp_path / "state.db")


def rows(store: TrajectoryStore, table) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def completion(traj_id: str, version: int) -> Generated:
    return Generated(traj_id, (5, 6, 7), (-0.5, -0.25, -0.125), ((version, 0, 3),), "stop", "inst-0")


def sample(store: TrajectoryStore, version: int) -> list[str]:
    """A batch's groups sampled, reserved and routed (the spare member too)."""
    start = int(store.meta.get("next_prompt", "0"))
    groups = store.add_groups([(start + i, f"{start + i} + 1", "x", (1, 2)) for i in range(BATCH)], MEMBERS, NEEDED,
                              start + BATCH)
    for g in groups:
        store.set_group_version(g.group_id, version)
    store.checkout("inst-0", [m for g in groups for m in g.member_ids])
    return [g.group_id for g in groups]


def complete(store: TrajectoryStore, group_ids: list[str], version: int) -> None:
    """The needed members of the groups complete (the spare stays on its instance)."""
    members = [m for gid in group_ids for m in store.groups[gid].member_ids]
    store.completed([completion(m, version) for m in members if not m.endswith(f"-m{MEMBERS - 1}")])


def finish(store: TrajectoryStore, group_ids: list[str]) -> None:
    """Completed members are rewarded, the groups close (the spare is cancelled and acknowledged),
    the ledger consumes them, the trainer reads and frees the batch."""
    members = [m for gid in group_ids for m in store.groups[gid].member_ids]
    store.rewarded({m: (1.0, "correct") for m in members if store.trajs[m].state is TrajState.COMPLETED})
    for gid in group_ids:
        on_instances = store.close_group(gid, GroupState.OCCUPIED)
        store.cancelled([t.traj_id for t in on_instances])
    store.mark_consumed(group_ids)
    assert len(store.batch(group_ids)) == BATCH * NEEDED
    store.free(group_ids)


def train(store: TrajectoryStore, group_ids: list[str], version: int) -> None:
    complete(store, group_ids, version)
    finish(store, group_ids)


def step(store: TrajectoryStore, version: int) -> None:
    train(store, sample(store, version), version)


def test_the_live_store_stays_the_size_of_the_working_set(url: str) -> None:
    store = TrajectoryStore.open(url)
    try:
        for version in range(0, 120, 2):
            step(store, version)
            in_flight = sample(store, version + 1)  # only this batch is live: the trained ones left
            assert set(store.groups) == set(in_flight) and len(store.trajs) == BATCH * MEMBERS
            assert rows(store, ts_trajectories) == len(store.trajs) and rows(store, ts_groups) == len(store.groups)
            train(store, in_flight, version + 1)
            assert len(store.trajs) == 0
        assert store.archived_count() == 120 * BATCH * MEMBERS  # every trajectory archived, once
        assert rows(store, ts_groups_archive) == 120 * BATCH
        assert sum(store.counts().values()) == 0
    finally:
        store.close()


def test_a_restart_loads_only_live_rows_and_archiving_goes_on_after_it(url: str) -> None:
    store = TrajectoryStore.open(url)
    for version in range(20):
        step(store, version)
    in_flight = sample(store, 20)
    live = {t: (r.state, r.instance_id) for t, r in store.trajs.items()}
    store.close()

    store = TrajectoryStore.open(url)  # a restart: memory holds the live rows only, as they were
    try:
        assert {t: (r.state, r.instance_id) for t, r in store.trajs.items()} == live
        assert [t.traj_id for t, _ in store.routed("inst-0")] == sorted(live, key=lambda t: store.trajs[t].seq)
        assert store.archived_count() == 20 * BATCH * MEMBERS
        train(store, in_flight, 20)
        for version in range(21, 30):
            step(store, version)
        assert len(store.trajs) == 0
        assert store.archived_count() == 30 * BATCH * MEMBERS
        with store.engine.connect() as conn:  # no trajectory in both tables, none twice in the archive
            archived = conn.execute(select(ts_trajectories_archive.c.traj_id)).scalars().all()
        assert len(archived) == len(set(archived))
    finally:
        store.close()


def test_a_group_stays_live_until_its_last_member_is_done(url: str) -> None:
    """A consumed, freed group whose spare member is still being cancelled on an instance stays in
    the live store (the coordinator still lists it as routed) until the abort is acknowledged."""
    store = TrajectoryStore.open(url)
    try:
        group_ids = sample(store, 0)
        members = [m for gid in group_ids for m in store.groups[gid].member_ids]
        spares = [m for m in members if m.endswith(f"-m{MEMBERS - 1}")]
        store.completed([completion(m, 0) for m in members if m not in spares])
        store.rewarded({m: (0.5, "correct") for m in members if m not in spares})
        cancelling = [t.traj_id for gid in group_ids for t in store.close_group(gid, GroupState.OCCUPIED)]
        assert sorted(cancelling) == sorted(spares)
        store.mark_consumed(group_ids)
        batch = store.batch(group_ids)
        store.free(group_ids)
        assert set(store.groups) == set(group_ids)  # still live: a member is on an instance
        assert sorted(t.traj_id for t, _ in store.routed("inst-0")) == sorted(spares)
        assert [t.traj_id for t in store.cancellations()] == sorted(spares, key=lambda t: store.trajs[t].seq)
        first, second = (store.trajs[s].group_id for s in spares)
        assert store.completed([completion(spares[0], 0)]) == []  # a late completion: surplus, aborted
        assert set(store.groups) == {second}  # its group is done: it left with its last member
        assert store.returned([Generated(spares[1])], "inst-0") == {spares[1]: "aborted"}
        assert store.groups == {} and store.trajs == {}
        assert store.archived(first) and store.archived(second)
        with store.engine.connect() as conn:
            kept = conn.execute(select(ts_trajectories_archive.c.traj_id, ts_trajectories_archive.c.state,
                                       ts_trajectories_archive.c.reward)).all()
        trained = {t.traj_id for t, _ in batch}
        assert {r.traj_id for r in kept} == set(members)
        assert {r.traj_id for r in kept if r.state == TrajState.CONSUMED} == trained
        assert all(r.reward == 0.5 for r in kept if r.traj_id in trained)
        with pytest.raises(StoreConflict) as freed:  # a freed batch asked again: gone, said so
            store.batch(group_ids)
        assert freed.value.code is ErrorCode.BATCH_FREED
        assert store.returned([Generated(members[0])], "inst-0") == {members[0]: "unknown"}
        t, g = store.archived_trajectory(members[0])  # inspection reads it back
        assert (t.state, t.reward, t.tokens, g.group_id, g.state) == (
            TrajState.CONSUMED, 0.5, (), first, GroupState.CONSUMED)
        assert store.archived_trajectory("g999-m0") is None
    finally:
        store.close()


def test_completions_racing_the_archiving_lose_nothing(url: str) -> None:
    """Redelivered completions and the coordinator's polls run while batches are freed and archived:
    every trajectory ends archived exactly once, in the state it reached."""
    store = TrajectoryStore.open(url)
    stop = threading.Event()
    errors: list[BaseException] = []
    delivered: list[str] = []
    raced = threading.Event()

    def redeliver() -> None:
        try:
            while not stop.is_set():
                with store.lock:  # as first delivered: generated by the group's V_traj
                    done = [(t, store.groups[r.group_id].v_traj) for t, r in store.trajs.items()
                            if r.state in (TrajState.COMPLETED, TrajState.REWARDED)]
                for traj_id, v_traj in done[:4]:
                    store.completed([completion(traj_id, v_traj)])
                    delivered.append(traj_id)
                    raced.set()
                store.pending()
                store.routed("inst-0")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    racer = threading.Thread(target=redeliver)
    racer.start()
    try:
        for version in range(40):
            group_ids = sample(store, version)
            complete(store, group_ids, version)
            if version % 8 == 0:  # the racer redelivers at least these batches' completions before they close
                raced.clear()
                assert raced.wait(60), "the racer never redelivered a completion"
            finish(store, group_ids)
    finally:
        stop.set()
        racer.join(60)
    try:
        assert not errors, errors
        assert delivered  # the race happened
        assert store.trajs == {} and store.archived_count() == 40 * BATCH * MEMBERS
        with store.engine.connect() as conn:
            states = dict(conn.execute(select(ts_trajectories_archive.c.state, func.count())
                                       .group_by(ts_trajectories_archive.c.state)).all())
        assert states == {"consumed": 40 * BATCH * NEEDED, "aborted": 40 * BATCH * (MEMBERS - NEEDED)}
    finally:
        store.close()


def test_drop_retention_keeps_no_archive(url: str) -> None:
    store = TrajectoryStore.open(url, retention="drop")
    try:
        for version in range(10):
            step(store, version)
        assert store.trajs == {} and rows(store, ts_trajectories) == 0
        assert store.archived_count() == 0 and rows(store, ts_groups_archive) == 0
    finally:
        store.close()
    with pytest.raises(ValueError, match="retention must be"):
        TrajectoryStore.open(url, retention="keep")


def test_an_archive_write_the_database_refuses_loses_nothing(tmp_path: Path) -> None:
    url = db.sqlite_url(tmp_path / "state.db")
    store = TrajectoryStore.open(url)
    try:
        group_ids = sample(store, 0)
        with store.engine.begin() as conn:
            conn.execute(text("CREATE TRIGGER refuse BEFORE INSERT ON ts_groups_archive "
                              "BEGIN SELECT RAISE(ABORT, 'archive refused'); END"))
        with pytest.raises(StoreUnavailable, match="archive refused"):
            train(store, group_ids, 0)
        # the free was refused as a whole: the groups are consumed, their payloads still there
        assert set(store.groups) == set(group_ids)
        assert all(g.state is GroupState.CONSUMED for g in store.groups.values())
        assert len(store.batch(group_ids)) == BATCH * NEEDED
        with store.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse"))
        store.free(group_ids)
        assert store.trajs == {} and store.archived_count() == BATCH * MEMBERS
    finally:
        store.close()


# --------------------------------------------------------------------------- the ledger's event log

PARAMS = LedgerParams(eta=1, batch_size=2, group_size=1)


def ledger_steps(ledger: DurableLedger, start: int, count: int) -> None:
    for version in range(start, start + count):
        for i in range(2):
            ledger.reserve(f"g{version}-{i}", version)
            ledger.occupy(f"g{version}-{i}")
        ledger.abort(ledger.reserve(f"s{version}", version).group_id)  # a surplus group, aborted
        assert ledger.consume().buffer == version


def event_count(ledger: DurableLedger) -> int:
    with ledger.engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(ledger_events)).scalar_one()


def test_the_ledger_compacts_retired_groups_events_across_restarts(url: str) -> None:
    ledger = DurableLedger.open(url, PARAMS, event_retention=20)
    try:
        ledger_steps(ledger, 0, 40)
        events = event_count(ledger)
        assert events <= 20 + 40 + 8  # the window, one consume a step, the newest step's events
        stats = ledger.stats
        assert (stats.admitted, stats.occupied, stats.consumed_buffers, stats.consumed_groups) == (120, 80, 40, 80)
    finally:
        ledger.close()
    ledger = DurableLedger.open(url, PARAMS, event_retention=20)
    try:
        stats = ledger.stats  # counted from the kept events and the compacted counts
        assert (stats.admitted, stats.occupied, stats.consumed_buffers, stats.consumed_groups) == (120, 80, 40, 80)
        with pytest.raises(LedgerError) as again:  # consumed once, for good: a retired group is not reserved again
            ledger.reserve("g3-0", 40)
        assert again.value.code is ErrorCode.DUPLICATE_GROUP
        ledger_steps(ledger, 40, 20)
        assert event_count(ledger) <= 20 + 60 + 8
        with ledger.engine.connect() as conn:
            counted = dict(conn.execute(select(ledger_event_counts.c.op, ledger_event_counts.c.count)).all())
        assert counted["reserve"] > 0 and "consume" not in counted
        # the follower's view: what is after its cursor is still in order, consume events all kept
        page = ledger.events(after=0, limit=1000)
        assert [e["id"] for e in page] == sorted(e["id"] for e in page)
        assert [e["buffer"] for e in page if e["op"] == "consume"] == list(range(60))
    finally:
        ledger.close()
    consumed, fates = consumption_record(url)  # the run's audit survives compaction
    assert len(consumed) == len(set(consumed)) == 120
    assert sorted(g for g, _, _ in fates) == sorted(consumed)


def test_event_retention_zero_keeps_every_event(url: str) -> None:
    ledger = DurableLedger.open(url, PARAMS, event_retention=0)
    try:
        ledger_steps(ledger, 0, 10)
        assert event_count(ledger) == 10 * (2 * 2 + 2 + 1)
    finally:
        ledger.close()


def collection_sizes(obj: object) -> dict[str, int]:
    """The size of every in-memory collection an object holds (its sized attributes)."""
    return {name: len(value) for name, value in vars(obj).items()
            if hasattr(value, "__len__") and not isinstance(value, str | bytes)}


def test_every_in_memory_collection_of_the_ledger_stays_bounded_however_long_the_run(url: str) -> None:
    """The ledger's memory holds the live groups and the recently retired ones only: the same
    sizes after 80 steps as after 10, across a restart, while a group retired long ago still
    cannot be reserved again (its id is looked up in the retired table)."""
    ledger = DurableLedger.open(url, PARAMS)
    try:
        ledger_steps(ledger, 0, 10)
        early = collection_sizes(ledger.ledger)
        assert early["_retired"] > 0
        ledger_steps(ledger, 10, 70)
        late = collection_sizes(ledger.ledger)
        assert late.keys() == early.keys()
        assert {k: n for k, n in late.items() if n > early[k]} == {}
        assert ledger.ledger.retired_count < 3 * (PARAMS.eta + 3)  # 3 groups retire a step; 240 retired in all
    finally:
        ledger.close()
    ledger = DurableLedger.open(url, PARAMS)
    try:
        assert {k: n for k, n in collection_sizes(ledger.ledger).items() if n > early[k]} == {}
        assert ledger.fate("g3-0") is GroupFate.CONSUMED and ledger.fate("s3") is GroupFate.ABORTED
        with pytest.raises(LedgerError) as again:  # consumed once, for good
            ledger.reserve("g3-0", 80)
        assert again.value.code is ErrorCode.DUPLICATE_GROUP
        with pytest.raises(LedgerError) as late_call:
            ledger.occupy("g3-1")
        assert late_call.value.code is ErrorCode.RETIRED_GROUP
        ledger_steps(ledger, 80, 10)
    finally:
        ledger.close()
    consumed, _ = consumption_record(url)
    assert len(consumed) == len(set(consumed)) == 2 * 90


def test_every_in_memory_collection_of_the_trajectory_store_stays_bounded_however_long_the_run(url: str) -> None:
    store = TrajectoryStore.open(url)
    try:
        for version in range(10):
            step(store, version)
        early = {**collection_sizes(store.book), **collection_sizes(store)}
        for version in range(10, 60):
            step(store, version)
        late = {**collection_sizes(store.book), **collection_sizes(store)}
        assert late.keys() == early.keys()
        assert {k: n for k, n in late.items() if n > early[k]} == {}
        assert store.archived_count() == 60 * BATCH * MEMBERS
    finally:
        store.close()


def test_opening_a_ledger_counts_its_statistics_without_scanning_its_history(tmp_path: Path) -> None:
    """A restart reads the retired groups' counts by fate from their own table: no statement it
    makes scans ``ledger_retired`` (every group of the run), so it costs the same at any age."""
    url = db.sqlite_url(tmp_path / "ledger.db")
    ledger = DurableLedger.open(url, PARAMS, event_retention=20)
    try:
        ledger_steps(ledger, 0, 30)
        before = ledger.stats
    finally:
        ledger.close()
    engine = db.make_engine(url)
    statements: list[tuple[str, object]] = []
    event.listen(engine, "before_cursor_execute",
                 lambda conn, cursor, statement, parameters, context, many: statements.append((statement, parameters)))
    ledger = DurableLedger(engine, PARAMS, event_retention=20)
    try:
        assert ledger.stats == before
        assert (before.consumed_groups, before.aborted) == (60, 30)
        reads = [(s, p) for s, p in statements if "ledger_retired" in s and s.lstrip().upper().startswith("SELECT")]
        assert reads, "the recently retired groups are read back"
        with engine.connect() as conn:
            for statement, parameters in reads:
                plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters).all()
                assert not [row for row in plan if re.search(r"SCAN ledger_retired\b", row[-1])], (statement, plan)
    finally:
        ledger.close()


def test_each_compaction_reads_only_the_events_since_the_last(tmp_path: Path) -> None:
    """The consume events stay for good (one a step): a compaction that read every event up to its
    window again would cost the run's length at every consume. Each reads an id range bounded below
    by where the last one stopped."""
    engine = db.make_engine(db.sqlite_url(tmp_path / "ledger.db"))
    counts: list[tuple[str, object]] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, parameters, context, many: counts.append(
        (statement, parameters)) if "GROUP BY ledger_events.op" in statement and "WHERE" in statement else None)
    ledger = DurableLedger(engine, PARAMS, event_retention=20)
    try:
        ledger_steps(ledger, 0, 30)
        ledger_steps(ledger, 30, 1)
        assert len(counts) >= 2
        statement, parameters = counts[-1]
        with engine.connect() as conn:
            plan = " ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
        assert re.search(r"SEARCH ledger_events USING INTEGER PRIMARY KEY \(rowid>\? AND rowid<\?\)", plan), plan
        assert event_count(ledger) <= 20 + 31 + 8
    finally:
        ledger.close()
