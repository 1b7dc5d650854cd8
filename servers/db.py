"""Database engines for the durable state: SQLite by default (a file per store in the state
directory, WAL, synchronous commits) or a PostgreSQL server (``postgresql+psycopg://``) for a
cluster, where the ledger and the trajectory store share one database. The schema is owned by the
Alembic migrations in ``migrations/`` and is the same on both.

What differs between the two, and where it is handled:

* durability: SQLite's ``synchronous`` pragma (FULL/NORMAL); on PostgreSQL, FULL keeps the
  server's ``synchronous_commit`` and NORMAL turns it off for the store's sessions (a commit can be
  lost if the *database server* crashes, never if the StaleFlow process does);
* concurrent schema upgrades: the manager and the trajectory server start side by side against the
  same PostgreSQL database, so ``upgrade`` holds a transaction-scoped advisory lock (SQLite files
  are per store and its write lock serializes upgrades anyway);
* dropped connections: PostgreSQL connections are checked before use (``pool_pre_ping``); the
  ledger's writer reconnects after a lost connection (``manager.store``); a store that starts
  while its server is down waits for it (``wait_until_reachable``) instead of failing;
* types: BLOB/BYTEA (``LargeBinary``), TEXT for JSON, FLOAT is double precision on both, and
  ``VARCHAR(n)`` is enforced by PostgreSQL only, so the REST models bound every stored id.
"""

from __future__ import annotations

import importlib.resources
import logging
import time
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from staleflow.backoff import Backoff
from staleflow.database_url import DatabaseUrlError, masked, normalize_url

__all__ = ["DatabaseError", "DatabaseInUse", "DatabaseUnreachable", "DatabaseUrlError", "OwnerLockHeld", "downgrade",
           "make_engine", "masked", "normalize_url", "owner_session", "upgrade", "wait_until_reachable"]

log = logging.getLogger(__name__)

STARTUP_WAIT_S = 900.0
"""How long a store that starts while its database server is down waits for it before giving up."""

# an arbitrary constant: the advisory lock that serializes StaleFlow's schema upgrades on a server
_UPGRADE_LOCK = 0x5354414C  # "STAL"


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, synchronous: str = "FULL") -> Engine:
    """Create an engine. SQLite connections get WAL and the chosen sync level; PostgreSQL ones are
    checked before use and, with ``synchronous="NORMAL"``, commit without waiting for the WAL flush."""
    url = normalize_url(url)
    if is_sqlite(url):
        if url not in ("sqlite://", "sqlite:///:memory:"):
            Path(url.split("///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    connect_args: dict[str, object] = {"connect_timeout": 10}
    if synchronous == "NORMAL":
        connect_args["options"] = "-c synchronous_commit=off"
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, isolation_level="READ COMMITTED")


def _alembic_config() -> AlembicConfig:
    cfg = AlembicConfig()
    # the revisions are read as files: the migrations import the schema, never the other way round
    cfg.set_main_option("script_location", str(importlib.resources.files("staleflow.migrations")))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Bring the schema to ``revision``; returns the revision now current. Safe to call from
    several processes at once on one PostgreSQL database: they take turns."""
    cfg = _alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _UPGRADE_LOCK})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return current_revision(engine) or ""


def downgrade(engine: Engine, revision: str = "base") -> str:
    """Take the schema back to ``revision``; ``base`` drops every StaleFlow table."""
    cfg = _alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _UPGRADE_LOCK})
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
    return current_revision(engine) or ""


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    return ScriptDirectory.from_config(_alembic_config()).get_current_head() or ""


def holds_run(engine: Engine) -> bool:
    """Whether the database holds a run's state: ledger settings or trajectory groups."""
    tables = set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        for table in ("ledger_settings", "ts_groups"):
            if table in tables and conn.execute(text(f"SELECT 1 FROM {table} LIMIT 1")).first() is not None:
                return True
    return False


# server-side keepalives of an owner's session: the server drops a vanished owner's session, and
# with it the lock, within ~25 s (10 s idle + 3 probes 5 s apart)
OWNER_KEEPALIVES = {"tcp_keepalives_idle": 10, "tcp_keepalives_interval": 5, "tcp_keepalives_count": 3}


class OwnerLockHeld(RuntimeError):
    """Another session holds the owner lock; the message names the database and the wait."""


def owner_session(engine: Engine, key: int, wait: float) -> Connection:
    """A connection whose session holds the advisory lock ``key`` (PostgreSQL; on SQLite a plain
    connection): the one writer of a store. Waits up to ``wait`` seconds for a holder to let go
    (0: try once); raises ``OwnerLockHeld`` if it does not."""
    conn = engine.connect()
    if conn.dialect.name != "postgresql":
        return conn
    try:
        for name, value in OWNER_KEEPALIVES.items():
            conn.execute(text(f"SET {name} = {int(value)}"))
        conn.commit()
        if wait > 0:  # the server queues us behind the holder, up to ``wait`` seconds
            try:
                conn.execute(text(f"SET LOCAL lock_timeout = {int(wait * 1000)}"))
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
                conn.commit()  # a session lock: it outlives the transaction
                held = True
            except OperationalError as exc:
                conn.rollback()
                if getattr(exc.orig, "sqlstate", None) != "55P03":  # not lock_timeout: a real failure
                    raise
                held = False
        else:
            held = bool(conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar())
            conn.commit()
        if not held:
            raise OwnerLockHeld(masked(engine.url.render_as_string(hide_password=False))
                                + (f" (waited {wait:.0f} s for it to let go)" if wait > 0 else ""))
    except BaseException:
        conn.close()
        raise
    return conn


def prepare_for_run(url: str, resume: bool, discard: bool) -> None:
    """Before a job starts on a database that outlives its state directory (a server, or a file
    elsewhere): check that it answers; a new run needs it empty, so a previous run's state is
    dropped when ``discard`` (``--fresh``, or the previous run finished) and refused otherwise;
    ``resume`` keeps it."""
    engine = make_engine(url)
    try:
        try:
            found = holds_run(engine)
        except OperationalError as exc:
            raise DatabaseUnreachable(
                f"cannot reach database {masked(url)}: {str(exc.orig or exc).strip().splitlines()[0]}; check the URL, "
                "that the server runs and that it accepts connections from this host") from None
        if not found or resume:
            return
        if not discard:
            raise DatabaseInUse(f"database {masked(url)} holds an unfinished run; continue it with --resume, "
                                "or start over with --fresh (drops StaleFlow's tables in it)")
        downgrade(engine, "base")
    finally:
        engine.dispose()


class DatabaseError(RuntimeError):
    """The durable state's database cannot be used for this run; the message says why."""


class DatabaseInUse(DatabaseError):
    """A new run was asked for on a database that holds another run's state."""


class DatabaseUnreachable(DatabaseError):
    """The database server did not accept a connection."""


def wait_until_reachable(engine: Engine, what: str, give_up_s: float = STARTUP_WAIT_S,
                         sleep: Callable[[float], object] = time.sleep) -> None:
    """Return once the database accepts a connection; while it does not (a server restarting, an
    outage), retry with capped, jittered backoff, logging the wait about every 30 s. Raises
    ``DatabaseUnreachable`` after ``give_up_s`` seconds. SQLite files always answer."""
    backoff, began, told = Backoff(0.5, 10.0), time.monotonic(), None
    where = masked(engine.url.render_as_string(hide_password=False))
    while True:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except OperationalError as exc:
            waited = time.monotonic() - began
            if waited >= give_up_s:
                raise DatabaseUnreachable(f"{what}: the database {where} did not answer in {give_up_s:.0f} s: "
                                          f"{str(exc.orig or exc).strip()}") from None
            if told is None or time.monotonic() - told >= 30:
                told = time.monotonic()
                log.warning("%s: the database %s does not answer (%s); waiting for it (%.0f s so far, giving up "
                            "after %.0f s)", what, where, str(exc.orig or exc).strip().splitlines()[0], waited, give_up_s)
            sleep(backoff.failed())  # retry pacing while the database server is down
            continue
        if told is not None:
            log.warning("%s: the database %s answers again after %.0f s", what, where, time.monotonic() - began)
        return
