"""Database engines for the durable state: SQLite by default (WAL, synchronous commits),
any SQLAlchemy URL otherwise. The schema is owned by the Alembic migrations in ``migrations/``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event

import staleflow.migrations


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def make_engine(url: str, synchronous: str = "FULL") -> Engine:
    """Create an engine; for SQLite every connection gets WAL and the chosen sync level."""
    if url.startswith("sqlite"):
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
    return create_engine(url, pool_pre_ping=True)


def _alembic_config() -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(staleflow.migrations.__file__).parent))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Bring the schema to ``revision``; returns the revision now current."""
    cfg = _alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return current_revision(engine) or ""


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    return ScriptDirectory.from_config(_alembic_config()).get_current_head() or ""
