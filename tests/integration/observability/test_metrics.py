"""Prometheus metrics: every service of a running job serves /metrics with the shared names, and
the Grafana dashboard queries only metrics some service exports."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleflow.config import JobConfig
from staleflow.launch.local import LocalJob
from staleflow.launch.plan import component_names
from staleflow.metrics import CATALOGUE

DASHBOARDS = sorted((Path(__file__).parents[3] / "deploy" / "grafana").glob("*.json"))
SERIES_SUFFIXES = {"counter": ("_total",), "summary": ("_count", "_sum"), "histogram": ("_bucket", "_count", "_sum")}


def exported(text: str) -> dict[str, str]:
    """Series name -> type, from a text exposition (families without samples included)."""
    series = {}
    for family in text_string_to_metric_families(text):
        for suffix in SERIES_SUFFIXES.get(family.type, ("",)):
            series[family.name + suffix] = family.type
    return series


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """component -> its /metrics text, scraped from a simulated job after it trained a step."""
    config = JobConfig.model_validate({
        "engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2, "steps": 4, "speed": 20,
        "ledger": {"batch_size": 4, "group_size": 2, "eta": 1}, "logger": [],
        "state_dir": str(tmp_path_factory.mktemp("metrics-job") / "state")})
    job = LocalJob(config)
    try:
        job.start()
        deadline = time.monotonic() + 90
        while len(job.steps()) < 2 and not job.finished():  # trained and pulled: every kind of work happened
            assert time.monotonic() < deadline, "the job trained no step in 90 s"
            job.stop.wait(0.1)  # polling pacing
        with httpx.Client(timeout=10) as client:
            for name in component_names(config):  # one request each is counted by every service alike
                client.get(f"{job.endpoints[name]['url']}/v1/health").raise_for_status()
            yield {name: client.get(f"{job.endpoints[name]['url']}/metrics").text for name in component_names(config)}
    finally:
        job.shutdown()


def test_every_service_serves_the_shared_metrics(scraped: dict[str, str]) -> None:
    roles = {"manager": "manager", "params": "params", "reward": "reward", "ts": "ts", "coordinator": "coordinator",
             "inst-0": "instance", "inst-1": "instance"}
    assert set(scraped) == set(roles)
    for name, text in scraped.items():
        families = {f.name: f for f in text_string_to_metric_families(text)}
        info = families["staleflow_component_info"].samples
        assert [s.labels["component"] for s in info] == [roles[name]], name
        assert all(f.startswith("staleflow_") for f in families), name
        requests = [s for s in families["staleflow_http_requests"].samples if s.name.endswith("_total")]
        assert all(s.labels["component"] == roles[name] for s in requests), name
        assert any(s.labels["route"] == "/v1/health" for s in requests), name
    routes = {s.labels["route"] for f in text_string_to_metric_families(scraped["ts"]) for s in f.samples
              if s.name == "staleflow_http_requests_total"}
    assert "/v1/batches/{version}" in routes  # route templates, not one series per id


def test_one_name_one_type_across_processes(scraped: dict[str, str]) -> None:
    types: dict[str, set[str]] = {}
    for text in scraped.values():
        for series, kind in exported(text).items():
            types.setdefault(series, set()).add(kind)
    assert {s: k for s, k in types.items() if len(k) > 1} == {}
    catalogue = {series for metric in CATALOGUE for series in metric.series}
    assert catalogue <= set(types), f"in the catalogue but exported by no service: {sorted(catalogue - set(types))}"


def test_the_running_job_shows_in_its_metrics(scraped: dict[str, str]) -> None:
    def value(component: str, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(scraped[component]):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise KeyError(f"{name} {labels} not in {component}'s metrics")

    assert value("manager", "staleflow_ledger_train_version") >= 2
    assert value("coordinator", "staleflow_coordinator_cycles_total") > 0
    assert value("coordinator", "staleflow_coordinator_command_seconds_count", kind="route") > 0
    assert value("coordinator", "staleflow_coordinator_decision_seconds_count") > 0
    assert value("params", "staleflow_params_pushes_total") >= 1
    assert value("ts", "staleflow_trajectories_completed_total") >= 8
    assert value("inst-0", "staleflow_instance_completed_trajectories_total", instance_id="inst-0") > 0
    parts = {p: value("inst-0", "staleflow_instance_engine_seconds_total", instance_id="inst-0", part=p)
             for p in ("decode", "prefill", "pull", "idle")}
    rollout = value("inst-0", "staleflow_instance_rollout_seconds_total", instance_id="inst-0", source="simulated")
    assert sum(parts.values()) == pytest.approx(rollout) and parts["decode"] > 0


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda p: p.name)
def test_the_dashboard_queries_only_exported_metrics(dashboard: Path, scraped: dict[str, str]) -> None:
    series = {s for text in scraped.values() for s in exported(text)}
    panels = json.loads(dashboard.read_text())["panels"]
    queried = set()
    for panel in panels:
        for target in panel.get("targets", []):
            names = set(re.findall(r"\bstaleflow_[a-z0-9_]+", target["expr"]))
            assert names, f"panel {panel['title']!r} queries no StaleFlow metric: {target['expr']}"
            queried |= names
    assert queried and queried <= series, f"queried but exported by no service: {sorted(queried - series)}"


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS, "deploy/grafana/ holds the Grafana dashboard"
