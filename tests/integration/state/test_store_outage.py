"""A database outage pauses the stores instead of ending them: a store that starts while its
PostgreSQL server is down waits for it, and one whose server goes away refuses writes, says so
without touching the database (what health reports), and picks up again once the server is back."""

from __future__ import annotations

import importlib.util
import logging
import threading
import time

import pytest
from support import free_port

from staleflow.servers import db
from staleflow.servers.trajectories.store import StoreUnavailable, TrajectoryStore


def until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a condition with a deadline


def test_waiting_for_an_unreachable_database_is_bounded_and_says_where() -> None:
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("the psycopg driver is not installed")
    engine = db.make_engine(f"postgresql+psycopg://nobody:secret@127.0.0.1:{free_port()}/none")
    waits: list[float] = []
    try:
        with pytest.raises(db.DatabaseUnreachable, match=r"the ledger: the database .*127\.0\.0\.1.* did not answer"):
            db.wait_until_reachable(engine, "the ledger", give_up_s=1.0, sleep=lambda s: (waits.append(s), time.sleep(0.1)))
    finally:
        engine.dispose()
    assert waits and all(0 < w <= 10.0 for w in waits)
    assert "secret" not in repr(waits)


@pytest.mark.postgres
def test_a_store_started_during_an_outage_waits_for_its_database(own_postgres, caplog) -> None:
    url = own_postgres.create_database()
    own_postgres.halt()
    opened: list[TrajectoryStore] = []
    with caplog.at_level(logging.WARNING, logger="staleflow.servers.db"):
        opener = threading.Thread(target=lambda: opened.append(TrajectoryStore.open(url)), daemon=True)
        opener.start()
        until(lambda: any("does not answer" in r.getMessage() for r in caplog.records), "the wait to be logged")
        assert opener.is_alive() and not opened, "it waits instead of failing"
        own_postgres.resume()
        opener.join(120)
    assert opened, "it started once the database answered"
    store = opened[0]
    try:
        assert store.counts() == {} or sum(store.counts().values()) == 0
        assert any("answers again" in r.getMessage() for r in caplog.records)
    finally:
        store.close()


@pytest.mark.postgres
def test_a_store_whose_database_goes_away_refuses_writes_and_says_why_then_resumes(own_postgres) -> None:
    store = TrajectoryStore.open(own_postgres.create_database())
    try:
        store.set_meta("before", "1")
        assert store.unavailable is None
        own_postgres.halt()
        with pytest.raises(StoreUnavailable):
            store.set_meta("during", "1")
        assert store.unavailable is not None  # what health reports, as "degraded"
        assert store.counts_in_memory() == store.book.counts(), "answered from memory, the database down"
        with pytest.raises(StoreUnavailable):
            store.counts()  # a read that needs the reload waits for the database
        own_postgres.resume()
        until(lambda: _reloads(store), "the store to reload once the database is back")
        assert store.unavailable is None
        store.set_meta("after", "1")
        assert store.meta.get("before") == "1" and "during" not in store.meta, "the refused write did not linger"
    finally:
        store.close()


def _reloads(store: TrajectoryStore) -> bool:
    try:
        store.counts()
    except StoreUnavailable:
        return False
    return True
