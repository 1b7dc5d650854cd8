"""`staleflow up` with the deployment's token ($STALEFLOW_TOKEN_FILE, a mounted secret): the run
uses it instead of generating one, and endpoints.json names its file for the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.servers.auth import TOKEN_FILE_ENV


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
