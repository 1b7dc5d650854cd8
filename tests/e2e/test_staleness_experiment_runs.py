"""`staleflow experiment staleness` end to end on small simulated jobs: every planned run is a
real `staleflow up`, the figure and the numbers come out, finished runs are reused, and the
unbounded run trains on trajectories older than any bounded run allows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from staleflow.cli.main import app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SIM_JOB = {"engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2, "speed": 20,
           "ledger": {"batch_size": 4, "group_size": 2}}


def test_runs_each_bound_and_the_unbounded_contrast_then_plots(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(SIM_JOB))
    out, figure = tmp_path / "runs", tmp_path / "img" / "staleness.png"
    args = ["experiment", "staleness", "--etas", "0,1", "--steps", "6", "--config", str(job), "--out", str(out),
            "--figure", str(figure), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    reply = json.loads(result.output.strip().splitlines()[-1])
    runs = {r["label"]: r for r in reply["runs"]}
    assert list(runs) == ["eta = 0", "eta = 1", "no bound (eta = steps = 6)"]
    assert figure.stat().st_size > 10_000
    assert json.loads((out / "staleness.json").read_text())["runs"] == reply["runs"]
    for r in runs.values():
        assert r["steps"] == 6 and len(r["rewards"]) == len(r["finished_at"]) == 6
        assert r["tokens_per_second"] > 0 and r["staleness_violations"] == 0
        assert r["finished_at"] == sorted(r["finished_at"])
    assert runs["eta = 0"]["max_staleness"] == 0 and runs["eta = 1"]["max_staleness"] <= 1
    assert runs["no bound (eta = steps = 6)"]["max_staleness"] > 1, "without a bound the last batches are old"

    # finished runs are reused: plotting again runs nothing and gives the same numbers
    again = CliRunner().invoke(app, [*args, "--plot-only"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output.strip().splitlines()[-1])["runs"] == reply["runs"]


def test_a_failing_run_stops_the_experiment_with_its_log(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**SIM_JOB, "instances": 0}))  # refused by `staleflow up`
    result = CliRunner().invoke(app, ["experiment", "staleness", "--etas", "0", "--no-unbounded", "--steps", "2",
                                      "--config", str(job), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 1
    assert "eta = 0" in result.output and "eta0.out" in result.output
