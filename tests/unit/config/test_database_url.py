"""Database URLs: what StaleFlow accepts, and the errors a user sees for the others."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.config import JobConfig
from staleflow.database_url import DatabaseUrlError, masked, normalize_url


@pytest.mark.parametrize(("url", "expected"), [
    ("sqlite:///tmp/x.db", "sqlite:///tmp/x.db"),
    ("postgresql://u@h:5432/d", "postgresql+psycopg://u@h:5432/d"),
    ("postgres://u:pw@h/d", "postgresql+psycopg://u:pw@h/d"),
    ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d"),
])
def test_supported_urls_are_normalized_to_their_driver(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


@pytest.mark.parametrize(("url", "message"), [
    ("ledger.db", "is not a URL"),
    ("mysql://u@h/d", "'mysql' is not supported"),
    ("postgresql+psycopg2://u@h/d", "driver 'psycopg2' is not supported"),
    ("postgresql://u:secret@h:5432", "names no database"),
])
def test_unsupported_urls_are_refused_with_the_fix(url: str, message: str) -> None:
    with pytest.raises(DatabaseUrlError, match=message) as err:
        normalize_url(url)
    assert "secret" not in str(err.value)
    assert "sqlite:///PATH" in str(err.value) or "postgresql+psycopg://" in str(err.value)


def test_passwords_are_masked() -> None:
    assert masked("postgresql+psycopg://u:secret@h/d") == "postgresql+psycopg://u:***@h/d"


def test_db_url_file_keeps_the_password_out_of_the_job_file(tmp_path: Path) -> None:
    secret = tmp_path / "url"
    secret.write_text("postgresql://staleflow:secret@db:5432/staleflow\n")
    config = JobConfig(engine="sim", db_url_file=secret)
    assert config.database_url() == "postgresql://staleflow:secret@db:5432/staleflow"
    assert "secret@" not in config.model_dump_json()
    assert config.database_label() == "postgresql://staleflow:***@db:5432/staleflow"
    secret.write_text("")
    with pytest.raises(DatabaseUrlError, match="is empty"):
        config.database_url()
    with pytest.raises(DatabaseUrlError, match="cannot read it"):
        JobConfig(engine="sim", db_url_file=tmp_path / "missing").database_url()
    with pytest.raises(ValueError, match="db_url or db_url_file, not both"):
        JobConfig(engine="sim", db_url="sqlite:///x.db", db_url_file=secret)


def _up(tmp_path: Path, **fields: object):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"engine": "sim", **fields}))
    return CliRunner().invoke(app, ["up", "--config", str(job), "--steps", "1", "--state-dir", str(tmp_path / "run")])


def test_up_names_a_bad_database_url_and_its_fix(tmp_path: Path) -> None:
    result = _up(tmp_path, db_url="mysql://root:secret@db/staleflow")
    said = " ".join(result.output.split())  # the console wraps long lines
    assert result.exit_code == 2
    assert "db_url" in said and "'mysql' is not supported" in said and "secret" not in said


def test_up_says_when_the_database_server_does_not_answer(tmp_path: Path) -> None:
    from support import free_port

    result = _up(tmp_path, db_url=f"postgresql://staleflow:secret@127.0.0.1:{free_port()}/staleflow")
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert "cannot reach database" in said and "secret" not in said
