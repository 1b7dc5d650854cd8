"""The control plane stays closed: tokens on mutating endpoints, no open non-loopback binds."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import httpx
import pytest
from support import manager_config
from typer.testing import CliRunner

from staleflow.api.base import ServiceError
from staleflow.api.manager import ManagerClient
from staleflow.cli.main import app
from staleflow.servers.auth import TOKEN_ENV, InsecureBind
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app


def test_mutations_need_the_token_reads_do_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serve_in_thread(create_app(manager_config(tmp_path)), token="s3cret") as server:
        with ManagerClient(server.url) as anonymous:
            assert anonymous.buffers().train_version == 0, "reads stay open"
            for call in (lambda: anonymous.reserve("g", 0), anonymous.consume):
                with pytest.raises(ServiceError) as refused:
                    call()
                assert refused.value.status == 401 and "bearer token" in refused.value.detail
            assert anonymous.buffers().buffers[0].entries == [], "refused requests change nothing"
        wrong = httpx.post(f"{server.url}/v1/reservations", json={"group_id": "g", "v_traj": 0},
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "wrong" in wrong.json()["detail"]
        with ManagerClient(server.url, token="s3cret") as owner:
            assert owner.reserve("g", 0).group_id == "g"


def test_the_environment_token_is_used_by_servers_and_clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    with serve_in_thread(create_app(manager_config(tmp_path))) as server, ManagerClient(server.url) as client:
        assert client.reserve("g", 0).buffer == 1
        assert httpx.post(f"{server.url}/v1/consume").status_code == 401


def test_non_loopback_bind_without_a_token_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(InsecureBind, match="without a token"):
        serve_in_thread(create_app(manager_config(tmp_path)), host="0.0.0.0")
    result = CliRunner().invoke(app, ["serve", "manager", "--host", "0.0.0.0", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--token" in result.output


def test_loopback_without_a_token_runs_open_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serve_in_thread(create_app(manager_config(tmp_path))) as server, ManagerClient(server.url) as client:
        assert client.reserve("g", 0)
    assert "without a token" in caplog.text


def test_up_writes_an_owner_only_token_and_the_cli_uses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and every file and directory of the run's state is owner-only, from its creation on."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = tmp_path / "run"
    state.mkdir(mode=0o755)
    (state / "left-by-an-earlier-run.txt").write_text("x")
    (state / "left-by-an-earlier-run.txt").chmod(0o644)
    umask = os.umask(0o022)
    os.umask(umask)
    result = CliRunner().invoke(app, ["up", "--engine", "sim", "--steps", "1", "--state-dir", str(state), "--workload", "ci-tiny",
                                      "--max-tokens", "32", "--instances", "1", "--batch-size", "2", "--group-size",
                                      "2", "--eta", "1"])
    assert result.exit_code == 0, result.output
    endpoints = json.loads((state / "endpoints.json").read_text())
    token_file = Path(endpoints["token_file"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token_file.read_text()) >= 32
    paths = [state, *state.rglob("*")]
    assert {"ledger.db", "trajectories.db", "job.json", "logs"} <= {p.name for p in paths}
    exposed = [(str(p.relative_to(tmp_path)), oct(stat.S_IMODE(p.lstat().st_mode))) for p in paths
               if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
    assert exposed == []
    assert os.umask(umask) == umask, "the job restores the process's umask"
    assert TOKEN_ENV not in os.environ, "the job hands its environment back as it found it"
