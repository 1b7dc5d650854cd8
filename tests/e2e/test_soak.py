"""`staleflow soak` end to end, small: a job of a hundred-odd steps (room for the end checkpoint
before the job finishes, even on a fast machine) whose trajectory server is killed
and restarted at the start and at the end; the live store stays at the working set while the
archive takes every finished trajectory, and no process's resident memory grows. The same soak
with instances that leak (a test engine that keeps 1 MiB per trajectory) fails, naming them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.cli.soak import MEMORY_GROWTH_LIMIT, SOAK_DEFAULTS
from staleflow.engines.factory import ENGINE_FACTORY_ENV

PROCESSES = {"manager", "params", "reward", "ts", "inst-0", "inst-1", "coordinator", "trainer"}


@pytest.mark.timeout(400)
def test_a_short_soak_reports_both_ends_and_a_bounded_live_store(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    result = CliRunner().invoke(app, [
        "soak", "--steps", "120", "--warmup", "8", "--end-margin", "60", "--sample-every", "5", "--window", "2",
        "--restarts", "1", "--state-dir", str(tmp_path / "run"), "--output", str(report_path), "--deadline", "300"])
    report = json.loads(report_path.read_text())
    assert report["finished"] and report["failure"] is None, (result.output, report["failure"])
    assert report["steps_done"] == 120
    start, end = report["start"], report["end"]
    # the end is measured in the run's last part: the margin before the last step grows with the run's pace
    assert start["step"] >= 8 and end["step"] >= 40 and end["step"] > start["step"] + 20
    for point in (start, end):  # the trajectory server came back from each SIGKILL
        assert point["ts_restart_s"] is not None and point["ts_restart_s"] > 0
        assert point["cycle_ms"] > 0 and point["poll_ms"] > 0
    # the working set: (eta + 1) batches in flight, plus consumed batches the trainer has not freed
    # yet; far below the 480 trajectories of the run's history
    per_batch = SOAK_DEFAULTS["batch_size"] * SOAK_DEFAULTS["group_size"]
    in_flight = (SOAK_DEFAULTS["eta"] + 1) * per_batch
    assert max(s["live_trajectories"] for s in report["samples"]) <= 3 * in_flight
    assert end["archived_trajectories"] > start["archived_trajectories"] > 0
    assert end["archived_trajectories"] >= per_batch * (end["step"] - 1)  # every trained trajectory left the live store
    last = report["samples"][-1]
    assert last["trajectories_db_bytes"] > 0 and last["ledger_db_bytes"] > 0
    assert set(report["ratios"]) == {"cycle_ms", "coordinator_cpu_ms", "job_cpu_ms_per_step", "poll_ms",
                                     "ts_restart_s", "live_trajectories"}
    for point in (start, end):  # what each cycle spends where, and the CPU the job's processes used
        assert {"snapshots", "routed"} <= set(point["phase_ms"]) and all(ms >= 0 for ms in point["phase_ms"].values())
        assert point["coordinator_cpu_ms"] is not None and point["coordinator_cpu_ms"] >= 0
        assert {"coordinator", "manager", "ts"} <= set(point["cpu_ms_per_step"])
    # resident memory, every process, first against last quarter of the span between the checkpoints
    growth = report["memory_growth"]
    assert set(growth) == PROCESSES, growth
    assert all(g["samples"] >= 8 for g in growth.values()), growth
    assert all(g["growth"] <= MEMORY_GROWTH_LIMIT for g in growth.values()), growth


@pytest.mark.timeout(400)
def test_the_soak_fails_on_instances_that_leak_and_names_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_FACTORY_ENV, "leaking_engine:build")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH")])))
    report_path = tmp_path / "soak.json"
    result = CliRunner().invoke(app, [
        "soak", "--steps", "90", "--warmup", "5", "--end-margin", "10", "--sample-every", "30", "--window", "1",
        "--restarts", "0", "--state-dir", str(tmp_path / "run"), "--output", str(report_path), "--deadline", "300"])
    report = json.loads(report_path.read_text())
    assert report["failure"] is None, report["failure"]
    assert result.exit_code == 1, result.output
    growth = report["memory_growth"]
    for name in ("inst-0", "inst-1"):
        assert growth[name]["growth"] > MEMORY_GROWTH_LIMIT, growth
        assert f"memory grew: {name}" in " ".join(result.output.split()), result.output
