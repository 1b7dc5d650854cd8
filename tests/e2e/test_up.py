"""`staleflow up` as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support import group_state
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from typer.testing import CliRunner

from staleflow.cli.main import app

SMALL = ["--engine", "sim", "--workload", "ci-tiny", "--max-tokens", "48", "--instances", "2", "--batch-size", "4", "--group-size", "2",
         "--eta", "1", "--speed", "20"]


def test_up_runs_a_job_to_completion_with_a_report(tmp_path: Path) -> None:
    state = tmp_path / "run"
    result = CliRunner().invoke(app, ["up", "--steps", "3", "--state-dir", str(state), "--logger", "console,tensorboard",
                                      *SMALL])
    assert result.exit_code == 0, result.output
    assert "simulated trainer" in result.output, "the stand-in trainer is labelled as such"
    summary = json.loads((state / "report" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["staleness_violations"] == 0
    for version, levels in summary["staleness_per_buffer"].items():
        assert all(0 <= int(k) <= 1 for k in levels), f"buffer {version} breaks eta"
        assert sum(levels.values()) == 4 * 2
    assert summary["tokens_per_second"] > 0
    engine = summary["time_breakdown"]["engine"]
    assert engine["source"] == "simulated" and engine["instances"] == 2 and engine["seconds"]["decode"] > 0
    assert sum(engine["seconds"].values()) == pytest.approx(engine["rollout_seconds"])
    assert summary["time_breakdown"]["commands"]["count"]["route"] > 0
    for plot in ("instance_load.png", "staleness.png", "throughput.png", "time_breakdown.png", "length_skew.png"):
        assert (state / "report" / plot).stat().st_size > 1000
    # what the bound did to the lengths: every trained trajectory, in its step, with its staleness
    skew = summary["length_skew"]
    assert sum(skew["trained"].values()) == 3 * 4 * 2
    assert {w["step"]: sum(w["trained"].values()) for w in skew["per_step"] if w["trained"]} == {0: 8, 1: 8, 2: 8}
    assert sum(int(k) * n for k, n in skew["trained_lengths"].items()) == summary["response_tokens"]
    assert summary["failover"]["regenerated_tokens"] == 0, "no instance failed"
    assert "| length bucket |" in (state / "report" / "length_skew.md").read_text()
    # every step went to the console and to TensorBoard, read back from the event files
    assert [line.split(":")[0] for line in result.output.splitlines() if line.startswith("step ")] == \
        ["step 0", "step 1", "step 2"]
    events = EventAccumulator(str(state / "tracking" / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert rewards == [(s["version"], pytest.approx(s["mean_reward"])) for s in summary["per_step"]]
    assert {"staleness/mean", "train/seconds", "throughput/tokens_per_second", "instance/inst-0/running",
            "length_skew/trained", "length_skew/generated_mean"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("length_skew/trained")] == [8.0, 8.0, 8.0]
    endpoints = json.loads((state / "endpoints.json").read_text())
    assert {"manager", "ts", "params", "reward", "coordinator", "inst-0", "inst-1"} <= set(endpoints)
    # a finished run is replaced by a new one in the same directory; an unfinished one is protected
    (state / "report").rename(state / "kept")
    again = CliRunner().invoke(app, ["up", "--steps", "1", "--state-dir", str(state), *SMALL])
    assert again.exit_code == 2 and "--resume" in again.output


def _spawn_up(state: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "staleflow.cli", "up", "--json-log", "--state-dir", str(state),
                             *SMALL, *extra], stdout=subprocess.PIPE, text=True)


def _events(proc: subprocess.Popen):
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


@pytest.mark.timeout(300)
def test_inspect_mid_run_then_sigterm_then_resume(tmp_path: Path) -> None:
    state = tmp_path / "run"
    steps = 40
    proc = _spawn_up(state, "--steps", str(steps))
    urls = {}
    for event in _events(proc):
        if event["event"] == "component":
            urls[event["name"]] = event["url"]
        if event["event"] == "sample" and event["train_version"] >= 2:
            break
    # every component answers while the job runs
    with httpx.Client(timeout=10) as c:
        assert c.get(f"{urls['manager']}/v1/buffers").json()["train_version"] >= 2
        assert "staleflow_ledger_consumed_buffers_total" in c.get(f"{urls['manager']}/metrics").text
        assert len(c.get(f"{urls['coordinator']}/v1/instances").json()["instances"]) == 2
        assert c.get(f"{urls['coordinator']}/v1/commands").json()["commands"]
        assert c.get(f"{urls['ts']}/v1/trajectories", params={"state": "routed"}).status_code == 200
        assert c.get(f"{urls['params']}/v1/params").status_code == 200
    runner = CliRunner()
    for command in (["status"], ["buffers"], ["instances"], ["commands"]):
        out = runner.invoke(app, [*command, "--state-dir", str(state), "--json"])
        assert out.exit_code == 0, (command, out.output)
        json.loads(out.output)
    # asking the live job why its next buffer is not consumable yet (it may be consumed meanwhile)
    why = runner.invoke(app, ["buffers", "--why", "--state-dir", str(state), "--json"])
    assert why.exit_code == 0, why.output
    answer = json.loads(why.output)
    assert answer["version"] >= 2 and answer["summary"].startswith(f"buffer {answer['version']}")
    if answer["state"] != "consumed" and not answer["consumable"]:
        assert answer["needed"] > 0 and answer["groups"] or answer["unreserved"], answer
    what_if = runner.invoke(app, ["admission", "--version", "0", "--count", "2", "--state-dir", str(state), "--json"])
    assert what_if.exit_code == 0, what_if.output
    assert "too stale" in json.loads(what_if.output)["what_if"]["reason"], "version 0 is outside eta=1 by now"
    # one owner per state directory: a second `up` of any kind is refused at once, naming the live
    # one, and nothing of the live job's state is deleted or rewritten
    kept = {name: (state / name).read_bytes() for name in ("job.json", "endpoints.json", "token")}
    listing = sorted(p.name for p in state.iterdir())
    for second in (["--fresh"], ["--resume"], []):
        refused = runner.invoke(app, ["up", "--steps", "2", "--state-dir", str(state), *SMALL, *second])
        assert refused.exit_code == 2, (second, refused.output)
        assert f"pid {proc.pid}" in refused.output and "--state-dir" in refused.output, refused.output
        assert {name: (state / name).read_bytes() for name in kept} == kept
        assert set(listing) <= {p.name for p in state.iterdir()}
    version_then = json.loads(runner.invoke(app, ["buffers", "--state-dir", str(state), "--json"]).output)
    for event in _events(proc):  # the live job goes on
        if event["event"] == "sample" and event["train_version"] > version_then["train_version"]:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    for name in ("manager", "ts", "coordinator"):
        try:
            httpx.get(f"{urls[name]}/v1/health", timeout=2)
        except httpx.TransportError:
            continue
        raise AssertionError(f"{name} still answers after the job stopped")
    assert (state / "report-partial" / "summary.json").exists()

    resumed = CliRunner().invoke(app, ["up", "--resume", "--steps", str(steps), "--state-dir", str(state), *SMALL])
    assert resumed.exit_code == 0, resumed.output
    with httpx.Client(timeout=10) as c:
        from staleflow.config.manager import LedgerParams
        from staleflow.servers.manager.store import DurableLedger

        ledger = DurableLedger.open(f"sqlite:///{state / 'ledger.db'}", LedgerParams(eta=1, batch_size=4, group_size=2))
        try:
            assert ledger.train_version == steps
            seen: set[str] = set()
            for version in range(steps):
                groups = ledger.consumed_batch(version)
                assert len(groups) == 4, f"buffer {version} is not whole"
                assert seen.isdisjoint(groups), "a group was consumed twice"
                seen.update(groups)
        finally:
            ledger.close()
    from staleflow.servers.trajectories.store import TrajectoryStore

    store = TrajectoryStore.open(f"sqlite:///{state / 'trajectories.db'}")
    try:
        for g in seen:  # every trajectory of every consumed group reached the trainer (live or archived)
            assert group_state(store, g)[1] == ["consumed", "consumed"], g
    finally:
        store.close()


def test_compose_file_runs_the_jobs_components() -> None:
    """compose.yaml, deploy/job.json and deploy/endpoints.json describe the same job: every
    component plus the trainer, the token from .env (never baked into the image or the file),
    health checks on each service's own port, and a start order that follows the dependencies."""
    import yaml

    from staleflow.config import JobConfig
    from staleflow.launch.plan import TRAINER, build_app, component_names

    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "compose.yaml").read_text())
    endpoints = json.loads((root / "deploy" / "endpoints.json").read_text())
    job = JobConfig.model_validate_json((root / "deploy" / "job.json").read_text())
    names = component_names(job)
    services = compose["services"]
    assert set(names) == set(endpoints) and set(services) == {*names, TRAINER}
    started: set[str] = set()
    for name in [*names, TRAINER]:
        service = services[name]
        assert service["command"] == ["staleflow", "serve", "component", name, "--job", "/deploy/job.json",
                                      "--endpoints", "/deploy/endpoints.json"]
        assert service["env_file"] == ".env" and "environment" not in service, "the token comes from .env only"
        assert service["restart"] == "on-failure"
        depends = service.get("depends_on", {})
        assert set(depends) <= started, f"{name} waits for a service that starts after it"
        assert all(d["condition"] == "service_healthy" for d in depends.values())
        if name != TRAINER:
            assert endpoints[name]["host"] == "0.0.0.0", "reachable from the other containers (so: token needed)"
            assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{endpoints[name]['port']}/v1/health"
            assert build_app(name, job, endpoints).title  # every component builds from these files
        started.add(name)
    assert set(services[TRAINER]["depends_on"]) == {"manager", "ts", "params", "coordinator"}
    for ignore in (".gitignore", ".dockerignore"):
        assert ".env" in (root / ignore).read_text().split(), f".env (the token) must be in {ignore}"
