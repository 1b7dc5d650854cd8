"""The report's Table 3 view: only what was measured, labelled by source, engine parts summing to
the rollout time and command latencies kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow.report import plot_time_breakdown, plot_time_per_version, time_breakdown


def vllm_stats(decode: float, idle: float, versions: dict[str, dict[str, float]]) -> dict:
    parts = {"prefill": 1.0, "reprefill": 0.5, "decode": decode, "overhead": 2.0, "pull": 1.5, "idle": idle}
    return {"available": True, "source": "engine-measured", "method": "model steps timed in the vLLM worker",
            "rollout_seconds": sum(parts.values()), "breakdown_seconds": parts, "breakdown_per_version": versions}


def test_engine_parts_sum_to_rollout_time_and_commands_stay_apart() -> None:
    stats = {
        "inst-0": vllm_stats(10.0, 5.0, {"0": {"decode": 4.0, "pull": 0.0}, "1": {"decode": 6.0, "pull": 1.5}}),
        "inst-1": vllm_stats(8.0, 7.0, {"0": {"decode": 8.0, "pull": 1.5}}),
        "inst-2": {"available": False},
    }
    commands = {"route": 3.0, "route_count": 12, "interrupt": 0.5, "interrupt_count": 2, "pull": 4.0, "pull_count": 3,
                "mean_decision_ms": 0.3}
    view = time_breakdown(stats, commands, instances=3)
    engine = view["engine"]
    assert engine["source"] == "engine-measured" and engine["instances"] == 2
    assert engine["instances_without_accounting"] == ["inst-2"]  # nothing is estimated for it
    assert engine["rollout_seconds"] == pytest.approx(20.0 + 20.0)
    assert sum(engine["seconds"].values()) == pytest.approx(engine["rollout_seconds"])
    assert sum(engine["share"].values()) == pytest.approx(1.0)
    assert engine["seconds"]["decode"] == 18.0 and "route" not in engine["seconds"]
    assert engine["per_version"] == {"0": {"decode": 12.0, "pull": 1.5}, "1": {"decode": 6.0, "pull": 1.5}}
    assert view["commands"]["source"].startswith("coordinator command latency")
    assert view["commands"]["seconds"] == {"route": 3.0, "interrupt": 0.5, "abort": 0.0, "pull": 4.0, "repack": 0.0}
    assert view["commands"]["count"] == {"route": 12, "interrupt": 2, "abort": 0, "pull": 3, "repack": 0}


def test_a_sim_run_scales_command_latency_to_the_simulated_clock() -> None:
    sim = {"available": True, "source": "simulated", "rollout_seconds": 10.0,
           "breakdown_seconds": {"decode": 6.0, "prefill": 1.0, "pull": 1.0, "idle": 2.0}}
    view = time_breakdown({"inst-0": sim}, {"route": 0.5}, scale=40.0, instances=1)
    assert view["engine"]["source"] == "simulated" and "per_version" not in view["engine"]
    assert view["commands"]["seconds"]["route"] == 20.0 and "x40" in view["commands"]["source"]


def test_without_engine_accounting_the_engine_view_says_not_measured() -> None:
    view = time_breakdown({"inst-0": {"available": False}}, {"route": 1.0}, instances=1)
    assert view["engine"] == {"source": "not measured", "instances": 0, "instances_without_accounting": ["inst-0"]}
    assert view["commands"]["seconds"]["route"] == 1.0


def test_plots(tmp_path: Path) -> None:
    stats = {"inst-0": vllm_stats(10.0, 5.0, {"0": {"decode": 4.0}, "1": {"decode": 6.0, "pull": 1.5}})}
    view = time_breakdown(stats, {"route": 1.0, "route_count": 3}, instances=1)
    assert plot_time_breakdown(tmp_path / "t.png", view).stat().st_size > 1000
    assert plot_time_per_version(tmp_path / "v.png", view["engine"]["per_version"], "engine-measured").stat().st_size > 1000
    assert plot_time_breakdown(tmp_path / "none.png", {"engine": None, "commands": {"seconds": {}}}) is None
