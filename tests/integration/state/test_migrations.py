"""The Alembic migrations against the code's schema (``staleflow.servers.schema``): one head, the
migrated database equals the models' metadata, and upgrade/downgrade keep the rows they should."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import staleflow.migrations
from staleflow.servers import db, schema


def alembic_config(conn: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(staleflow.migrations.__file__).parent))
    config.attributes["connection"] = conn
    return config


def migrate(engine: sa.Engine, direction: str, revision: str) -> None:
    with engine.begin() as conn:
        getattr(command, direction)(alembic_config(conn), revision)


def tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


@pytest.fixture
def engine(tmp_path: Path, db_url: str | None) -> sa.Engine:
    """A fresh database on each backend: a SQLite file, or a PostgreSQL database (``db_url``)."""
    engine = db.make_engine(db_url or db.sqlite_url(tmp_path / "state.db"))
    yield engine
    engine.dispose()


def test_one_head() -> None:
    with sa.create_engine("sqlite://").connect() as conn:
        heads = ScriptDirectory.from_config(alembic_config(conn)).get_heads()
    assert heads == [db.head_revision()], heads


def test_the_migrated_schema_is_the_models_schema(engine: sa.Engine) -> None:
    assert db.upgrade(engine) == db.head_revision()
    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), schema.metadata)
    assert differences == []
    assert tables(engine) == set(schema.metadata.tables)


def ledger_rows(conn: sa.Connection) -> None:
    conn.execute(schema.ledger_settings.insert().values(
        id=1, eta=2, batch_size=4, batch_redundancy=0.0, group_size=2, group_redundancy=0.0, train_version=0,
        sealed="[]", created_at=1.0))
    conn.execute(schema.ledger_entries.insert().values(
        group_id="g1", v_traj=0, deadline=2, status="reserved", seq=1, occupied_seq=None, completed="[]"))


def trajectory_rows(conn: sa.Connection) -> None:
    conn.execute(schema.ts_groups.insert().values(
        group_id="g1", prompt_index=0, prompt_text="1+1", answer="2", prompt_ids=b"\x01\x00\x00\x00", members=2,
        needed=2, v_traj=0, state="open", seq=1, created_at=1.0))
    conn.execute(schema.ts_meta.insert().values(key="cursor", value="1"))


def test_upgrade_and_downgrade_with_rows_present(engine: sa.Engine) -> None:
    revisions = [r.revision for r in ScriptDirectory.from_config(alembic_config(None)).walk_revisions()][::-1]
    first = revisions[0]
    migrate(engine, "upgrade", first)
    with engine.begin() as conn:
        ledger_rows(conn)

    migrate(engine, "upgrade", "head")  # the later migrations keep the ledger's rows
    with engine.begin() as conn:
        assert conn.execute(sa.select(schema.ledger_entries.c.group_id)).scalars().all() == ["g1"]
        trajectory_rows(conn)

    migrate(engine, "downgrade", first)  # back to the first: its tables and rows stay, the rest go
    with engine.connect() as conn:
        assert conn.execute(sa.select(schema.ledger_settings.c.eta)).scalars().all() == [2]
    assert tables(engine) == {"ledger_settings", "ledger_entries", "ledger_retired", "ledger_events"}

    migrate(engine, "upgrade", "head")  # and up again onto the same rows
    assert db.current_revision(engine) == db.head_revision()
    with engine.connect() as conn:
        assert conn.execute(sa.select(schema.ledger_entries.c.group_id)).scalars().all() == ["g1"]
        assert conn.execute(sa.select(schema.ts_groups)).all() == []

    migrate(engine, "downgrade", "base")
    assert tables(engine) == set()


def test_the_retired_counts_start_from_what_an_older_ledger_retired(engine: sa.Engine) -> None:
    migrate(engine, "upgrade", "0006_carried")
    with engine.begin() as conn:
        conn.execute(schema.ledger_retired.insert(), [
            {"group_id": f"g{i}", "v_traj": 0, "fate": fate, "buffer": 0, "retired_at": 1.0}
            for i, fate in enumerate(["consumed"] * 5 + ["aborted"] * 2 + ["surplus"])])
    migrate(engine, "upgrade", "head")
    with engine.connect() as conn:
        counts = dict(conn.execute(sa.select(schema.ledger_retired_counts.c.fate,
                                             schema.ledger_retired_counts.c.count)).all())
    assert counts == {"consumed": 5, "aborted": 2, "surplus": 1}
