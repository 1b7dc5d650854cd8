"""The job-watching commands at 80 and 120 columns, against a live job on loopback (a manager, a
trajectory server, a parameter server, two sim instances on virtual clocks and a coordinator
routing to them): no header is cut mid-word, no line is wider than the terminal, and the default
views leave the raw details (host ids, callback URLs, outbox counters) to --verbose and --json."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from support import manager_and_trajectory_server
from typer.testing import CliRunner

from staleflow.api.base import http_client
from staleflow.cli.main import app
from staleflow.cli.tables import headline
from staleflow.config.strategy import MigrationMode, StrategyConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app

runner = CliRunner()
WIDTHS = (80, 120)


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
    return value


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A live job whose endpoints.json the commands find; returns its state directory."""
    state = tmp_path_factory.mktemp("job")
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, state, 512, eta=1, batch_size=2, group_size=2)
        params_url = stack.enter_context(serve_in_thread(params_app(ParamsConfig(port=0, state_dir=state / "params")))).url
        found: dict[str, dict[str, str]] = {"manager": {"url": manager_url}, "params": {"url": params_url},
                                            "ts": {"url": ts_url}}
        endpoints, clients = [], []
        for name in ("inst-0", "inst-1"):
            url = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
                instance_id=name, sim=SimConfig(workload="paper-20k", kv_budget=10**7),
                completion_callback_url=f"{ts_url}/v1/completed")))).url
            endpoints.append(InstanceEndpoint(instance_id=name, url=url))
            clients.append(stack.enter_context(http_client(url)))
            found[name] = {"url": url}
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, cycle_period=0.02, instances=endpoints,
            strategy=StrategyConfig(migration=MigrationMode.NONE)))))
        found["coordinator"] = {"url": coordinator.url}
        (state / "endpoints.json").write_text(json.dumps({**found, "state_dir": str(state)}))
        co = stack.enter_context(http_client(coordinator.url))
        # every admitted trajectory runs on an instance, and some have generated tokens
        wait_for(lambda: sum(len((i["snapshot"] or {}).get("run_trajs") or [])
                             for i in co.get("/v1/instances").json()["instances"]) == 8)
        for client in clients:
            client.post("/v1/sim/advance", json={"by": 0.5})
        wait_for(lambda: co.get("/v1/commands").json()["commands"])
        yield state


def header_lines(output: str) -> list[str]:
    """The lines of each table's header: from its top border to the line under the header."""
    lines, inside = [], False
    for line in output.splitlines():
        inside = inside or line.startswith("┏")
        if inside:
            lines.append(line)
        if line.startswith("┡"):
            inside = False
    return lines


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", [
    ["status"], ["status", "--verbose"], ["instances"], ["instances", "--verbose"], ["commands"], ["buffers"],
    ["buffers", "--why"], ["buffers", "--why", "--verbose"], ["admission"],
])
def test_each_command_fits_the_terminal(job: Path, command: list[str], width: int) -> None:
    result = runner.invoke(app, [*command, "--state-dir", str(job)], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= width
    headers = header_lines(result.output)
    assert headers, "prints a table"
    assert not any("…" in line for line in headers), "\n".join(headers)
    # the column names are whole words: a header wrapped between words still reads as them
    assert "…" not in result.output


def test_status_shows_headlines_and_leaves_the_details_to_verbose(job: Path) -> None:
    short = runner.invoke(app, ["status", "--state-dir", str(job)], env={"COLUMNS": "80"})
    assert short.exit_code == 0, short.output
    for name in ("manager", "params", "ts", "inst-0", "inst-1", "coordinator"):
        assert name in short.output
    assert "train version 0" in short.output and "sim engine" in short.output and "routed" in short.output
    for raw in ("host_id", "callback", "/v1/completed", "last_seq", "checkpointed_tokens", "http://"):
        assert raw not in short.output, raw
    wide = runner.invoke(app, ["status", "--state-dir", str(job)], env={"COLUMNS": "120"})
    assert "http://127.0.0.1:" in wide.output, "a wide terminal has room for the URLs"
    verbose = runner.invoke(app, ["status", "--verbose", "--state-dir", str(job)], env={"COLUMNS": "120"})
    assert "host_id" in verbose.output and "/v1/completed" in verbose.output and "last_seq" in verbose.output
    as_json = json.loads(runner.invoke(app, ["status", "--json", "--state-dir", str(job)]).output)
    assert as_json["inst-0"]["health"]["callback"]["url"].endswith("/v1/completed")


def test_instances_keep_the_speculative_state_for_wide_terminals_or_verbose(job: Path) -> None:
    narrow = runner.invoke(app, ["instances", "--state-dir", str(job)], env={"COLUMNS": "80"})
    assert "speculative" not in narrow.output and "inst-0" in narrow.output and "running" in narrow.output
    below = runner.invoke(app, ["instances", "--verbose", "--state-dir", str(job)], env={"COLUMNS": "80"})
    assert "speculative P" in below.output and "inst-1 v" in below.output.replace("\n", " ")
    wide = runner.invoke(app, ["instances", "--state-dir", str(job)], env={"COLUMNS": "120"})
    assert "speculative P" in wide.output


@pytest.mark.parametrize("health, expected", [
    ({"status": "ok", "workers": 2, "replaced_workers": 0, "timeouts": {}}, "2 workers"),
    ({"status": "ok", "workers": 1, "replaced_workers": 3, "timeouts": {"math": 2}}, "1 worker, 3 replaced, 2 timeouts"),
    ({"status": "ok", "latest": None, "versions": 0}, "nothing published, 0 kept"),
    ({"status": "ok", "counts": {"pending": 3, "routed": 5}, "skipped_prompts": {"count": 2, "reasons": {}},
      "progress": {"regenerated_tokens": 0}}, "5 routed, 3 pending, 2 prompts skipped"),
    ({"status": "ok", "instance_id": "i", "engine": "vllm", "outbox": {"last_seq": 9, "pending": 2, "dropped": 0}},
     "vllm engine, 9 completions, 2 undelivered"),
    ({"status": "ok", "cycles": 1}, "1 cycle"),
    (None, "does not answer"),
])
def test_headlines_name_what_needs_acting_on(health: dict | None, expected: str) -> None:
    assert headline(health) == expected
