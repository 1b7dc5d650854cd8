"""`staleflow up` with its durable state in a configured database: PostgreSQL, or a SQLite file
outside the state directory; a database holding a run is never silently reused."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from sqlalchemy import select, text
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.servers import db
from staleflow.servers.schema import ledger_settings, ts_groups

SMALL = {"engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2, "speed": 20,
         "ledger": {"eta": 1, "batch_size": 4, "group_size": 2}}


def test_up_keeps_its_durable_state_in_the_configured_database(tmp_path: Path, db_url: str | None) -> None:
    """`staleflow up --engine sim` with `db_url` in the job file: PostgreSQL, or (the other
    backend) a SQLite file outside the state directory."""
    url = db_url or f"sqlite:///{tmp_path / 'elsewhere' / 'state.db'}"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**SMALL, "db_url": url}))
    state = tmp_path / "run"
    result = CliRunner().invoke(app, ["up", "--config", str(job), "--steps", "2", "--state-dir", str(state),
                                      "--json-log"])
    assert result.exit_code == 0, result.output
    summary = json.loads((state / "report" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["staleness_violations"] == 0
    assert not (state / "ledger.db").exists() and not (state / "trajectories.db").exists()
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(ledger_settings.c.train_version)).scalar() == 2
            assert conn.execute(select(text("count(*)")).select_from(ts_groups)).scalar() >= 2 * 4
    finally:
        engine.dispose()
    # a new run in another state directory must not silently reuse (or wipe) this run's state
    other = CliRunner().invoke(app, ["up", "--config", str(job), "--steps", "1", "--state-dir", str(tmp_path / "b")])
    said = " ".join(other.output.split())  # the console wraps long lines
    assert other.exit_code == 2 and "holds an unfinished run" in said and "--fresh" in said
