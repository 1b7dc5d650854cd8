"""The durable ledger's group commit: the calls of one batch are applied and written in one database
transaction, whether a new group id retired long ago is looked up once for the whole batch, and a
batch the database refuses fails every call in it and leaves memory as the database has it; on
SQLite and PostgreSQL."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from sqlalchemy import select, text

from staleflow.errors import ErrorCode
from staleflow.ledger import LedgerError, LedgerParams, Transition
from staleflow.servers import db
from staleflow.servers.manager.store import DurableLedger, StoreError
from staleflow.servers.schema import ledger_events

PARAMS = LedgerParams(eta=1, batch_size=8)


@pytest.fixture
def url(tmp_path: Path, db_url: str | None) -> str:
    return db_url or db.sqlite_url(tmp_path / "ledger.db")


def step(ledger: DurableLedger, version: int, aborted: str | None = None) -> None:
    """One training step: a full buffer of groups of this version consumed (and one more aborted)."""
    for i in range(PARAMS.batch_size):
        ledger.reserve(f"g{version}-{i}", version)
        ledger.occupy(f"g{version}-{i}")
    if aborted is not None:
        ledger.abort(ledger.reserve(aborted, version).group_id)
    assert ledger.consume().buffer == version


def in_one_batch(ledger: DurableLedger, calls: list[tuple]) -> list[Future[Transition]]:
    """Submit ``calls`` so that the writer takes them as one batch: it is held at the ledger's lock
    on a first call meanwhile (a query), and the rest wait in its queue until the lock is released."""
    with ledger._lock:
        blocker = ledger.submit("abort", "no-such-group")
        deadline = time.monotonic() + 30
        while not ledger._queue.empty():  # the writer has taken the blocker and waits for the lock
            assert time.monotonic() < deadline, "the writer never took the first call"
            time.sleep(0.001)
        futures = [ledger.submit(*call) for call in calls]
    assert blocker.exception(timeout=30) is not None  # refused: no such group
    for future in futures:
        future.exception(timeout=30)  # settled
    return futures


def code_of(future: Future) -> ErrorCode | None:
    exc = future.exception()
    return exc.code if exc is not None else None


def test_one_batch_refuses_ids_retired_long_ago_and_reused_in_it_and_admits_the_rest(url: str) -> None:
    ledger = DurableLedger.open(url, PARAMS)
    try:
        step(ledger, 0, aborted="dropped")
        for version in range(1, 2 * DurableLedger.retired_kept_versions(PARAMS)):
            step(ledger, version)
        t = ledger.train_version
        assert ledger.ledger.fate("g0-1") is not None and "g0-1" not in ledger.ledger._retired, \
            "the early groups must have left memory for the lookup to matter"
        futures = in_one_batch(ledger, [
            ("reserve", "g0-1", t),  # consumed long ago
            ("reserve", "new-0", t),
            ("reserve", "dropped", t),  # aborted long ago
            ("reserve", "new-0", t),  # live since a moment ago, in this batch
            ("reserve", "new-1", t),
            ("abort", "new-1"),
            ("reserve", "new-1", t),  # retired in this batch
            ("occupy", "new-0"),
        ])
        assert [code_of(f) for f in futures] == [ErrorCode.DUPLICATE_GROUP, None, ErrorCode.DUPLICATE_GROUP,
                                                 ErrorCode.DUPLICATE_GROUP, None, None,
                                                 ErrorCode.DUPLICATE_GROUP, None]
        assert "was already consumed" in str(futures[0].exception())
        assert "was already aborted" in str(futures[2].exception())
        with ledger.engine.connect() as conn:  # the accepted calls were written by one transaction
            written = conn.execute(select(ledger_events.c.op, ledger_events.c.group_id, ledger_events.c.at)
                                   .order_by(ledger_events.c.id.desc()).limit(4)).all()
        assert [(op, g) for op, g, _ in reversed(written)] == [("reserve", "new-0"), ("reserve", "new-1"),
                                                              ("abort", "new-1"), ("occupy", "new-0")]
        assert len({at for _, _, at in written}) == 1
    finally:
        ledger.close()
    reopened = DurableLedger.open(url, PARAMS)
    try:
        assert reopened.entry("new-0").status.value == "occupied" and reopened.fate("new-1").value == "aborted"
        with pytest.raises(LedgerError) as again:
            reopened.reserve("g0-1", reopened.train_version)
        assert again.value.code is ErrorCode.DUPLICATE_GROUP
    finally:
        reopened.close()


def refuse_group(engine, group_id: str | None) -> None:
    """Make the database refuse to store a ledger entry for ``group_id`` (None: stop refusing)."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"ALTER TABLE ledger_entries ADD CONSTRAINT refused CHECK (group_id <> '{group_id}')"
                              if group_id else "ALTER TABLE ledger_entries DROP CONSTRAINT refused"))
        else:
            conn.execute(text(f"CREATE TRIGGER refused BEFORE INSERT ON ledger_entries WHEN NEW.group_id = '{group_id}' "
                              "BEGIN SELECT RAISE(ABORT, 'refused'); END" if group_id else "DROP TRIGGER refused"))


def test_a_refused_write_fails_its_whole_batch_and_memory_follows_the_database(url: str) -> None:
    ledger = DurableLedger.open(url, PARAMS)
    try:
        step(ledger, 0)
        ledger.reserve("kept", 1)
        before = ledger.admission()
        refuse_group(ledger.engine, "refused")
        futures = in_one_batch(ledger, [("reserve", "fine", 1), ("occupy", "kept"), ("reserve", "refused", 1)])
        for future in futures:
            assert isinstance(future.exception(), StoreError) and "could not persist" in str(future.exception())
        assert ledger.entry("fine") is None and ledger.entry("refused") is None
        assert ledger.entry("kept").status.value == "reserved" and ledger.admission() == before
        refuse_group(ledger.engine, None)
        assert ledger.reserve("fine", 1).group_id == "fine"  # the ids were never taken
        assert ledger.occupy("kept").group_id == "kept"
    finally:
        ledger.close()


def test_when_the_retired_lookup_fails_every_call_of_the_batch_fails_and_none_hangs(url: str) -> None:
    ledger = DurableLedger.open(url, PARAMS)
    try:
        step(ledger, 0)
        ledger.reserve("kept", 1)
        with ledger.engine.begin() as conn:
            conn.execute(text("ALTER TABLE ledger_retired RENAME TO ledger_retired_away"))
        try:
            futures = in_one_batch(ledger, [("occupy", "kept"), ("reserve", "new", 1)])
            for future in futures:
                assert isinstance(future.exception(), StoreError)
            assert ledger.entry("kept").status.value == "reserved" and ledger.entry("new") is None
        finally:
            with ledger.engine.begin() as conn:
                conn.execute(text("ALTER TABLE ledger_retired_away RENAME TO ledger_retired"))
        assert ledger.reserve("new", 1).group_id == "new"
        assert ledger.occupy("kept").group_id == "kept"
    finally:
        ledger.close()
