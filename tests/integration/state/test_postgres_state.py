"""The durable state on a PostgreSQL server: the same migrations, one owner per ledger and per
trajectory store, a writer that survives a dropped connection, the consumption record the fault
audit reads (on both backends). A whole `staleflow up` job on a database: tests/e2e/test_up_database.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from staleflow.config.manager import LedgerParams
from staleflow.servers import db
from staleflow.servers.manager.store import DurableLedger, LedgerInUse, StoreError, consumption_record
from staleflow.servers.trajectories.store import StoreUnavailable, TrajectoryStore, TrajectoryStoreInUse

PARAMS = LedgerParams(eta=1, batch_size=2, group_size=1)
TABLES = {"ledger_settings", "ledger_entries", "ledger_retired", "ledger_events", "ledger_event_counts", "ts_groups",
          "ts_trajectories", "ts_groups_archive", "ts_trajectories_archive", "ts_progress",
          "ts_finished_lengths", "ledger_retired_counts",
          "ts_meta", "alembic_version"}


@pytest.fixture
def pg_url(postgres_server) -> str:
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


@pytest.mark.postgres
def test_migrations_upgrade_and_downgrade_on_postgres(pg_url: str) -> None:
    engine = db.make_engine(pg_url)
    try:
        assert db.upgrade(engine) == db.head_revision()
        assert set(inspect(engine).get_table_names()) == TABLES
        assert db.downgrade(engine, "base") == ""
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        assert db.upgrade(engine) == db.head_revision()
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_sync_levels_map_to_synchronous_commit(pg_url: str) -> None:
    """FULL waits for the WAL flush; NORMAL (the trajectory store's default) does not, so a commit
    can be lost only if the database server itself crashes."""
    for level, expected in (("FULL", "on"), ("NORMAL", "off")):
        engine = db.make_engine(pg_url, level)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SHOW synchronous_commit")).scalar() == expected
        finally:
            engine.dispose()


@pytest.mark.postgres
def test_manager_and_trajectory_server_upgrade_one_database_at_once(pg_url: str) -> None:
    """They start side by side on a cluster: the advisory lock makes them take turns."""
    engines = [db.make_engine(pg_url) for _ in range(4)]
    barrier = threading.Barrier(len(engines))
    results: list[object] = []

    def upgrade(engine) -> None:
        barrier.wait()
        try:
            results.append(db.upgrade(engine))
        except Exception as exc:  # collected: the assertion below names it
            results.append(exc)

    threads = [threading.Thread(target=upgrade, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in engines:
        e.dispose()
    assert results == [db.head_revision()] * len(engines)


@pytest.mark.postgres
def test_a_second_manager_cannot_write_the_same_ledger(pg_url: str) -> None:
    first = DurableLedger.open(pg_url, PARAMS)
    try:
        first.reserve("a", 0)
        with pytest.raises(LedgerInUse, match="another staleness manager holds the ledger"):
            DurableLedger(db.make_engine(pg_url), PARAMS, owner_wait=0.5)
    finally:
        first.close()
    second = DurableLedger.open(pg_url, PARAMS)  # the first one let go: the ledger moves on
    try:
        assert second.entry("a") is not None
        second.reserve("b", 0)
    finally:
        second.close()


@pytest.mark.postgres
def test_a_second_trajectory_server_cannot_open_the_same_store(pg_url: str) -> None:
    first = TrajectoryStore.open(pg_url)
    try:
        with pytest.raises(TrajectoryStoreInUse, match="another trajectory server holds the store"):
            TrajectoryStore(db.make_engine(pg_url), owner_wait=0.5)
        ledger = DurableLedger.open(pg_url, PARAMS)  # the ledger's owner lock is a different one
        ledger.close()
    finally:
        first.close()
    TrajectoryStore.open(pg_url).close()


@pytest.mark.postgres
def test_the_writer_reconnects_after_its_session_is_killed(pg_url: str, postgres_server) -> None:
    ledger = DurableLedger.open(pg_url, PARAMS)
    try:
        ledger.reserve("a", 0)
        with postgres_server.admin() as admin:  # what a server restart or a network cut does to the session
            killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                                   (pg_url.rsplit("/", 1)[1],)).fetchall()
        assert killed
        with pytest.raises(StoreError):
            ledger.reserve("b", 0)  # in flight when the connection died: refused, not half-applied
        assert ledger.entry("b") is None
        ledger.reserve("b", 0)  # the writer reconnected, took the owner lock again and reloaded
        ledger.occupy("a")
        ledger.occupy("b")
        assert ledger.consume().consumed == ["a", "b"]
    finally:
        ledger.close()
    reopened = DurableLedger.open(pg_url, PARAMS)
    try:
        assert reopened.train_version == 1 and reopened.consumed_batch(0) == ["a", "b"]
    finally:
        reopened.close()


@pytest.mark.postgres
def test_a_new_run_drops_a_previous_runs_tables_only_when_asked(pg_url: str) -> None:
    DurableLedger.open(pg_url, PARAMS).close()
    TrajectoryStore.open(pg_url).close()
    db.prepare_for_run(pg_url, resume=True, discard=False)  # resuming keeps it
    with pytest.raises(db.DatabaseInUse, match="holds an unfinished run.*--resume.*--fresh"):
        db.prepare_for_run(pg_url, resume=False, discard=False)
    db.prepare_for_run(pg_url, resume=False, discard=True)
    engine = db.make_engine(pg_url)
    try:
        assert not db.holds_run(engine)
    finally:
        engine.dispose()


def test_the_consumption_record_is_read_back_from_either_database(tmp_path: Path, db_url: str | None) -> None:
    """What the fault harness audits after a run: consumed once each, in order, with their buffer."""
    url = db_url or f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = DurableLedger.open(url, PARAMS)
    try:
        for g in ("a", "b"):
            ledger.reserve(g, 0)
            ledger.occupy(g)
        ledger.consume()
    finally:
        ledger.close()
    consumed, fates = consumption_record(url)
    assert sorted(consumed) == ["a", "b"] and sorted(fates) == [("a", 0, 0), ("b", 0, 0)]


def refuse_routing(engine, on: bool) -> None:
    """Make the database refuse to mark trajectories routed (a write failure on demand)."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE ts_trajectories ADD CONSTRAINT no_routing CHECK (state <> 'routed')"
                              if on else "ALTER TABLE ts_trajectories DROP CONSTRAINT no_routing"))
        else:
            conn.execute(text("CREATE TRIGGER no_routing BEFORE UPDATE ON ts_trajectories WHEN NEW.state = 'routed' "
                              "BEGIN SELECT RAISE(ABORT, 'refused'); END" if on else "DROP TRIGGER no_routing"))


def test_a_refused_trajectory_write_leaves_nothing_behind_in_memory(tmp_path: Path, db_url: str | None) -> None:
    url = db_url or f"sqlite:///{tmp_path / 'trajectories.db'}"
    store = TrajectoryStore.open(url)
    try:
        group = store.add_groups([(0, "1+1", "2", (1, 2))], members=2, needed=2, next_prompt=1)[0]
        store.set_group_version(group.group_id, 0)
        refuse_routing(store.engine, True)
        with pytest.raises(StoreUnavailable, match="could not persist"):
            store.checkout("inst-0", group.member_ids)
        assert {t.state.value for t, _ in store.pending()} == {"pending"} and len(store.pending()) == 2
        assert store.routed() == [], "memory does not keep what the database refused"
        refuse_routing(store.engine, False)
        assert len(store.checkout("inst-0", group.member_ids)) == 2
    finally:
        store.close()
    reopened = TrajectoryStore.open(url)
    try:
        assert len(reopened.routed("inst-0")) == 2
    finally:
        reopened.close()
