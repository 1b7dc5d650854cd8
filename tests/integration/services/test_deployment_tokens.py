"""Tokens as deployments hand them over: compose's .env, and a mounted secret file named by
$STALEFLOW_TOKEN_FILE (Kubernetes). A component bound beyond loopback starts with either and
refuses to start without one. `staleflow up` with a token file: tests/e2e/test_up_token_file.py."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest

from staleflow.config import JobConfig
from staleflow.launch.plan import build_app
from staleflow.servers.auth import TOKEN_ENV, TOKEN_FILE_ENV, InsecureBind
from staleflow.servers.http import serve_in_thread

ROOT = Path(__file__).resolve().parents[3]


def compose_manager(tmp_path: Path):
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
