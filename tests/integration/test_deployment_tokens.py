"""Tokens as deployments hand them over: compose's .env, and a mounted secret file named by
$STALEFLOW_TOKEN_FILE (Kubernetes). A component bound beyond loopback starts with either and
refuses to start without one."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.config import JobConfig
from staleflow.servers.auth import TOKEN_ENV, TOKEN_FILE_ENV, InsecureBind
from staleflow.servers.http import serve_in_thread
from staleflow.servers.job import build_app

ROOT = Path(__file__).resolve().parents[2]


def compose_manager(tmp_path: Path):  # noqa: ANN202
    """The manager as compose.yaml runs it: deploy/job.json, bound to 0.0.0.0 (state in tmp_path)."""
    job = JobConfig.model_validate_json((ROOT / "deploy" / "job.json").read_text()).model_copy(
        update={"state_dir": tmp_path})
    endpoints = json.loads((ROOT / "deploy" / "endpoints.json").read_text())
    return build_app("manager", job, endpoints), endpoints["manager"]["host"]


def test_a_compose_service_starts_with_the_env_file_token_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app_, host = compose_manager(tmp_path)
    with pytest.raises(InsecureBind, match="without a token"):
        serve_in_thread(app_, host, 0)
    token = secrets.token_urlsafe(32)  # what docs/cluster.md writes into .env
    (tmp_path / ".env").write_text(f"{TOKEN_ENV}={token}\n")
    key, value = (tmp_path / ".env").read_text().strip().split("=", 1)  # what compose's env_file does
    monkeypatch.setenv(key, value)
    app_, host = compose_manager(tmp_path)
    with serve_in_thread(app_, host, 0) as server:
        url = "http://127.0.0.1:" + server.url.rsplit(":", 1)[1]
        assert httpx.get(f"{url}/v1/buffers").status_code == 200
        body = {"group_id": "g", "v_traj": 0}
        assert httpx.post(f"{url}/v1/reservations", json=body).status_code == 401
        assert httpx.post(f"{url}/v1/reservations", json=body, headers={"Authorization": f"Bearer {token}"}).is_success


def test_a_token_file_protects_a_component(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-secret\n")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(secret))
    app_, host = compose_manager(tmp_path)
    with serve_in_thread(app_, host, 0) as server:
        url = "http://127.0.0.1:" + server.url.rsplit(":", 1)[1] + "/v1/reservations"
        assert httpx.post(url, json={"group_id": "g", "v_traj": 0}).status_code == 401
        assert httpx.post(url, json={"group_id": "g", "v_traj": 0},
                          headers={"Authorization": "Bearer from-a-secret"}).is_success
    secret.write_text("")
    with pytest.raises(InsecureBind, match="missing, unreadable or empty"):
        serve_in_thread(compose_manager(tmp_path)[0], host, 0)


def test_up_uses_the_mounted_token_and_names_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret" / "token"
    secret.parent.mkdir()
    secret.write_text("the-deployments-token")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(secret))
    state = tmp_path / "run"
    result = CliRunner().invoke(app, ["up", "--engine", "sim", "--workload", "ci-tiny", "--max-tokens", "48",
                                      "--instances", "1", "--batch-size", "2", "--group-size", "2", "--eta", "1",
                                      "--speed", "20", "--steps", "1", "--state-dir", str(state), "--json-log"])
    assert result.exit_code == 0, result.output
    assert json.loads((state / "endpoints.json").read_text())["token_file"] == str(secret.resolve())
    assert not (state / "token").exists(), "no second token next to the deployment's"
