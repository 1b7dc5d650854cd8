"""The command line as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

from support import free_port, manager_config
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.servers.db import head_revision
from staleflow.servers.clients import ManagerClient
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app

runner = CliRunner()


def test_buffers_table_and_json(tmp_path: Path) -> None:
    with serve_in_thread(create_app(manager_config(tmp_path))) as server, ManagerClient(server.url) as client:
        client.reserve("a", 0)
        client.occupy("a")
        table = runner.invoke(app, ["buffers", "--url", server.url])
        assert table.exit_code == 0, table.output
        assert "train version 0" in table.output and "waiting" in table.output
        as_json = runner.invoke(app, ["buffers", "--url", server.url, "--json"])
        data = json.loads(as_json.output)
        assert data["buffers"][0]["entries"] == [{"group_id": "a", "v_traj": 0, "status": "occupied"}]


def test_buffers_finds_the_running_job_through_endpoints_json(tmp_path: Path) -> None:
    with serve_in_thread(create_app(manager_config(tmp_path))) as server:
        (tmp_path / "endpoints.json").write_text(json.dumps({"manager": {"url": server.url}}))
        result = runner.invoke(app, ["buffers", "--state-dir", str(tmp_path), "--json"])
        assert result.exit_code == 0 and json.loads(result.output)["eta"] == 1


def test_no_manager_gives_a_fix_not_a_traceback(tmp_path: Path) -> None:
    result = runner.invoke(app, ["buffers", "--url", f"http://127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "no staleness manager answers" in result.output and "staleflow up" in result.output
    assert "Traceback" not in result.output


def test_invalid_settings_name_the_flag(tmp_path: Path) -> None:
    result = runner.invoke(app, ["serve", "manager", "--eta", "-1", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "eta (--eta)" in result.output and "greater than or equal to 0" in result.output
    result = runner.invoke(app, ["serve", "manager", "--db", "not-a-url", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "is not a URL" in result.output


def test_db_upgrade_creates_the_schema(tmp_path: Path) -> None:
    result = runner.invoke(app, ["db", "upgrade", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"schema at revision {head_revision()}" in result.output.replace("\n", "")
    assert (tmp_path / "ledger.db").exists()
