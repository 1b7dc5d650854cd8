"""``staleflow bench coordinator``: both strategies it measures, and a bad one refused with the fix."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from staleflow.cli import bench
from staleflow.config.strategy import MigrationMode, SyncMode
from staleflow.simulation.decision_bench import decision_strategy

runner = CliRunner()


def _app() -> typer.Typer:
    app, group = typer.Typer(), typer.Typer()
    app.add_typer(group, name="bench")
    bench.register(group)
    return app


def test_the_staleflow_strategy_is_what_the_simulated_staleflow_runs() -> None:
    config = decision_strategy("staleflow")
    assert (config.sync, config.migration) == (SyncMode.LOAD_AWARE, MigrationMode.STARVED)
    assert decision_strategy("default").sync is SyncMode.SELECTIVE


def test_a_small_decision_bench_routes_every_initial_trajectory() -> None:
    result = runner.invoke(_app(), ["bench", "coordinator", "--instances", "4", "--trajectories", "32",
                                    "--repeats", "1", "--strategy", "staleflow", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["strategy"] == "staleflow"
    initial = next(r for r in data["rows"] if r["scenario"] == "initial fill")
    assert initial["routed"] == 32 and initial["median_ms"] > 0
    assert all(r["cpu_min_ms"] > 0 and r["peak_mib"] > 0 for r in data["rows"])


def test_an_unknown_strategy_says_which_ones_exist() -> None:
    result = runner.invoke(_app(), ["bench", "coordinator", "--strategy", "greedy"])
    assert result.exit_code != 0
    assert "default, staleflow, repack" in result.output


def test_the_repack_strategy_checks_repack_on_every_pass() -> None:
    config = decision_strategy("repack")
    assert config.migration is MigrationMode.STARVED_REPACK
    result = runner.invoke(_app(), ["bench", "coordinator", "--instances", "8", "--trajectories", "64",
                                    "--repeats", "1", "--strategy", "repack", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert {r["scenario"] for r in rows} == {"initial fill", "steady"} and all("repacks" in r for r in rows)
