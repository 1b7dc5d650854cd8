"""``staleflow bench systems`` on the CI preset: the smoke run a user (and CI) does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from staleflow.cli import bench_systems
from staleflow.simulation import ExperimentSpec, resolve, run_experiment, scenario
from staleflow.simulation.systems import catalog
from staleflow.simulation.tables import markdown, tables

runner = CliRunner()
ALL = [s.name for s in catalog()]


def _app() -> typer.Typer:
    app, bench = typer.Typer(), typer.Typer()
    app.add_typer(bench, name="bench")
    bench_systems.register(bench)
    return app


APP = _app()


def invoke(*args: str):
    return runner.invoke(APP, ["bench", "systems", "--preset", "ci", "--jobs", "1", *args])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    result = invoke("--json", str(out / "results.json"), "--out", str(out / "figures"), "--markdown")
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text()), out, result.output


def test_smoke_run_completes_within_the_bound_with_every_system(smoke: tuple[dict, Path, str]) -> None:
    data, _, output = smoke
    assert "0 violations" in output
    assert data["summary"]["violations"] == 0
    assert data["systems"] == ALL
    assert [p["eta"] for p in data["points"]] == [1, 2, 3, 4]
    for point in data["points"]:
        assert list(point["runs"]) == ALL
        for name, run in point["runs"].items():
            assert run["violations"] == 0, name
            staleness = {int(s) for hist in run["staleness"].values() for s in hist}
            if name in ("in-flight-fifo", "laminar", "oracle"):  # completion order: over-eta ones are counted
                assert (run["exceedances"] > 0) == (max(staleness) > run["eta"]), name
            else:
                assert staleness and max(staleness) <= run["eta"] and run["exceedances"] == 0, name
            assert run["steps"] == 10 and len(run["step_records"]) == 10
    summary = data["summary"]
    assert set(summary["exceedances"]) == set(ALL) and set(summary["oracle_share"]) == set(ALL)
    assert summary["oracle_share"]["oracle"]["mean"] == 1.0
    assert set(summary["oracle_eta_share"]) == set(ALL)
    assert all(p["oracle_eta"] > 0 and set(p["oracle_eta_share"]) == set(ALL) for p in data["points"])
    assert all(p["oracle_eta_schedule"] <= p["oracle_eta"] for p in data["points"])
    assert summary["above_oracle_eta"] == [], "no system that keeps the bound passes its upper bound"
    assert {"vs", "steady_vs", "violations", "gap_recovered", "all_vanilla_vs_in_flight"} <= set(summary)
    assert set(summary["realised_staleness"]) == set(ALL)
    matched = data["matched"]  # StaleFlow at the completion-order peer's realised p99 and max, at every eta
    assert {m["peer"] for m in matched} == {"in-flight-fifo", "laminar"}
    assert {m["peer_eta"] for m in matched} == {1, 2, 3, 4}
    for m in matched:
        assert m["staleflow_eta"] in (m["realised_p99"], m["realised_max"]) and m["staleflow_violations"] == 0
        assert m["ratio"] == m["staleflow_throughput"] / m["peer_throughput"]


def test_smoke_json_is_well_formed(smoke: tuple[dict, Path, str]) -> None:
    data, _, _ = smoke
    typed = {"throughput": float, "total_time_s": float, "response_tokens": int, "mean_response": float,
             "max_response": int, "instances": int, "train_gpus": int, "eta": int, "violations": int,
             "system": str, "family": str, "wall_s": float, "step_time_s": float, "steady_throughput": float}
    for point in data["points"]:
        for run in point["runs"].values():
            for key, kind in typed.items():
                assert isinstance(run[key], kind), (key, run[key])
            assert set(run["breakdown"]) == {"decode_s", "prefill_s", "pull_s", "route_s", "interrupt_s", "train_s",
                                             "idle_s"}
            assert abs(sum(run["breakdown_fractions"].values()) - 1) < 1e-9
            assert {"mean_ms", "p99_ms", "planned", "cycles"} <= set(run["decisions"])
            assert run["decisions"]["planned"] >= 1
        assert set(point["ratios"]["sf-rsm"]) == {"synchronous", "one-step", "in-flight-limited", "completion-order",
                                                  "laminar"}
        assert all(isinstance(v, float) and v > 0 for v in point["ratios"]["sf-rsm"].values())
    vs = data["summary"]["vs"]
    assert set(vs) == {"synchronous", "one-step", "in-flight-limited", "completion-order", "laminar"}
    assert set(data["summary"]["steady_vs"]) == set(vs)
    assert vs["synchronous"]["paper_max"] == 2.68
    assert data["summary"]["all_vanilla_vs_in_flight"]["max_deviation"] >= 0


def test_smoke_writes_figures_and_markdown(smoke: tuple[dict, Path, str]) -> None:
    _, out, output = smoke
    figures = out / "figures"
    for name in ("fig13_throughput", "fig16_ablation", "fig17_instance_load", "fig18_staleness", "repack",
                 "staleness_tradeoff"):
        assert (figures / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
    md = (figures / "results.md").read_text()
    assert "| sf-rsm |" in md and "Gains" in md and "cf. Table 3" in md
    assert "| ratio |" in output, "--markdown prints the tables"


def test_same_seed_same_numbers() -> None:
    def numbers(seed: int) -> list:
        spec = ExperimentSpec(scenario("ci", seed), tuple(resolve("headline")), (1, 3), steps=4)
        result = run_experiment(spec)
        return [(p.point.label, name, r.throughput, r.total_time_s, r.staleness) for p in result.points
                for name, r in p.runs.items()]

    assert numbers(7) == numbers(7)
    assert numbers(7) != numbers(8)


def test_sweep_and_workload_file(tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("\n".join(json.dumps([10 * (g + 1) + m for m in range(4)]) for g in range(6)))
    result = invoke("--systems", "headline", "--eta", "1", "--steps", "3", "--sweep", "gpus=8,12",
                    "--workload", str(lengths), "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "f"))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["sweep"] == {"key": "gpus", "values": [8, 12]}
    assert data["scenario"]["workload"] == "lengths" and data["scenario"]["max_response_tokens"] == 63
    assert [p["label"] for p in data["points"]] == ["8, eta=1", "12, eta=1"]
    assert (tmp_path / "f" / "fig15_scaling.png").exists()


@pytest.mark.parametrize("args, message", [
    (("--systems", "nope"), "unknown system"),
    (("--sweep", "colour=1"), "--sweep takes"),
    (("--eta", "x"), "--eta takes"),
    (("--preset", "huge"), "unknown preset"),
    (("--workload", "/nonexistent/lengths.json"), "cannot use --workload"),
    (("--straggler-sigma", "-0.5"), "--straggler-sigma must be >= 0"),
    (("--weight-source", "carrier-pigeon"), "choose one of ps, ros"),
    (("--ps-egress-gbps", "0"), "--ps-egress-gbps must be > 0"),
    (("--systems", "verl+ros"), "does not Pull from a parameter server"),
    (("--sweep", "ps_egress=0"), "values must be > 0"),
])
def test_bad_options_say_what_to_fix(args: tuple[str, ...], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_report_tables_have_a_row_per_system() -> None:
    spec = ExperimentSpec(scenario("ci"), tuple(resolve("headline")), (2,), steps=3, detail_eta=2)
    result = run_experiment(spec)
    throughput, gains, matched, detail, breakdown, skew = tables(result)
    assert [row[0] for row in matched.rows] == [m.peer for m in result.matched]
    assert {m.peer for m in result.matched} == {"in-flight-fifo", "laminar"}, "every peer that does not keep the bound"
    assert [row[0] for row in throughput.rows] == ["verl", "one-step", "in-flight", "in-flight-fifo", "sf-rsm", "laminar",
                                                   "oracle", "oracle-eta", "oracle-eta schedule"]
    labels = [r[0] for r in gains.rows]
    assert sum(label.startswith("StaleFlow / ") for label in labels) == 10  # five peers, all steps and second half
    assert sum("/ oracle (" in label for label in labels) == 6, "every system's share of the upper bound"
    assert sum("/ oracle-eta (" in label for label in labels) == 7, "every system's share of the bounded one"
    assert any("gap to the oracle" in label for label in labels)
    assert all(len(r) == len(gains.header) for r in gains.rows)
    assert [row[0] for row in detail.rows] == [row[0] for row in breakdown.rows] == [row[0] for row in skew.rows]
    assert all(len(r) == len(skew.header) and r[1] != "-" for r in skew.rows), "every system's length skew"
    md = markdown(result, "staleflow bench systems --preset ci")
    assert sum(line.startswith("|---") for line in md.splitlines()) == 6, "six tables"
    assert "staleflow bench systems --preset ci" in md


def test_straggler_sigma_is_a_sweep_key_and_changes_the_run(tmp_path: Path) -> None:
    result = invoke("--systems", "in-flight,staleflow,oracle", "--eta", "2", "--steps", "4",
                    "--sweep", "straggler_sigma=0,0.5", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    homogeneous, straggling = data["points"]
    assert [homogeneous["sweep_value"], straggling["sweep_value"]] == [0, 0.5]
    assert homogeneous["runs"]["in-flight"]["total_time_s"] != straggling["runs"]["in-flight"]["total_time_s"]
    assert homogeneous["oracle_share"]["oracle"] == 1.0
    assert 0 < data["summary"]["oracle_share"]["sf-rsm"]["mean"]


def test_peer_serving_runs_beside_the_fan_out_from_a_slow_parameter_server(tmp_path: Path) -> None:
    result = invoke("--systems", "staleflow,staleflow+ros", "--eta", "2", "--steps", "4", "--instances", "3",
                    "--ps-egress-gbps", "1.6", "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["systems"] == ["sf-rsm", "sf-rsm+ros"]
    assert data["scenario"]["weight_source"] == "ps" and data["scenario"]["ps_egress_gbps"] == 1.6
    runs = data["points"][0]["runs"]
    assert runs["sf-rsm+ros"]["violations"] == 0
    assert runs["sf-rsm+ros"]["breakdown"]["pull_s"] < runs["sf-rsm"]["breakdown"]["pull_s"]
