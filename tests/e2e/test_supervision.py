"""Supervision in every run: a plain `staleflow up` restarts a component that is killed from
outside and finishes every step intact; a component that keeps crashing stops the job with an
error naming it and its log."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from support import group_state

from staleflow.config import JobConfig, LedgerConfig
from staleflow.config.manager import LedgerParams
from staleflow.launch.local import LocalJob
from staleflow.servers.manager.store import DurableLedger
from staleflow.servers.trajectories.store import TrajectoryStore

ETA, BATCH, GROUP = 1, 4, 2
SMALL = ["--engine", "sim", "--workload", "ci-tiny", "--max-tokens", "48", "--instances", "2", "--batch-size",
         str(BATCH), "--group-size", str(GROUP), "--eta", str(ETA), "--speed", "20"]


def _spawn_up(state: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "staleflow.cli", "up", "--json-log", "--processes", "--state-dir",
                             str(state), *SMALL, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _events(proc: subprocess.Popen) -> Iterator[dict]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


def _pid_listening_on(port: int) -> int:
    """The process listening on 127.0.0.1:``port``, found the way an operator would (``ss -ltnp``)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            inodes.add(f"socket:[{inode}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"nothing listens on port {port}")


def _pids_running(text: str) -> list[int]:
    """Every process whose command line mentions ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except OSError:
            continue
    return found


def _pid_running(text: str) -> int:
    pids = _pids_running(text)
    if not pids:
        raise AssertionError(f"no process runs {text!r}")
    return pids[0]


def _assert_ledger_intact(state: Path, steps: int) -> None:
    """Every step present, no group consumed twice, every consumed group within eta, and every
    trajectory of a consumed group reached the trainer."""
    params = LedgerParams(eta=ETA, batch_size=BATCH, group_size=GROUP)
    ledger = DurableLedger.open(f"sqlite:///{state / 'ledger.db'}", params)
    store = TrajectoryStore.open(f"sqlite:///{state / 'trajectories.db'}")
    try:
        assert ledger.train_version == steps
        seen: set[str] = set()
        for version in range(steps):
            groups = ledger.consumed_batch(version)
            assert len(groups) == BATCH, f"buffer {version} is not whole"
            assert seen.isdisjoint(groups), f"buffer {version}: a group was consumed twice"
            seen.update(groups)
            for g in groups:
                v_traj, states = group_state(store, g)
                assert v_traj is not None and 0 <= version - v_traj <= ETA, (version, g, v_traj)
                assert states == ["consumed"] * GROUP, g
    finally:
        store.close()
        ledger.close()


def _assert_steps_intact(per_step: list[dict], steps: int) -> None:
    """The trainer trained every version once, in order, each batch within eta."""
    assert [s["version"] for s in per_step] == list(range(steps)), "every step once, in order"
    for step in per_step:
        assert all(0 <= int(k) <= ETA for k in step["staleness"]), step
        assert step["trajectories"] == BATCH * GROUP, step


@pytest.mark.timeout(400)
def test_every_role_sigkilled_from_outside_the_run_finishes_intact(tmp_path: Path) -> None:
    state = tmp_path / "run"
    # a kill once the previous victim is back and a step more trained: six kills need 7 steps at
    # least, and the steps trained while a victim recovers and between samples come on top (on a
    # loaded machine the last kill came at step 17 when each kill waited two steps)
    steps = 20
    victims = ["inst-0", "ts", "params", "manager", "coordinator", "trainer"]
    proc = _spawn_up(state, "--steps", str(steps))
    ports: dict[str, int] = {}
    killed: list[str] = []
    waiting_for: str | None = None
    next_at = 2
    restarts: list[dict] = []
    end: dict = {}
    try:
        for event in _events(proc):
            if event["event"] == "component" and event["url"].startswith("http"):
                ports[event["name"]] = int(event["url"].rsplit(":", 1)[1])
            elif event["event"] == "restart":
                restarts.append(event)
                if event["component"] == waiting_for and event["recovered_after_s"] is not None:
                    waiting_for = None
            elif event["event"] == "sample" and waiting_for is None and len(killed) < len(victims) \
                    and event["train_version"] >= next_at:
                victim = victims[len(killed)]
                pid = _pid_running(f"serve component trainer --job {state}") if victim == "trainer" \
                    else _pid_listening_on(ports[victim])
                os.kill(pid, signal.SIGKILL)  # from outside: the job is not told
                killed.append(victim)
                waiting_for = victim
                next_at = event["train_version"] + 1
            elif event["event"] == "end":
                end = event
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed == victims, f"only {killed} were killed before the run ended"
    assert end["completed"] and end["restarts"] == len(victims)
    summary = json.loads((state / "report" / "summary.json").read_text())
    assert [r["component"] for r in summary["restarts"]] == victims
    for r in summary["restarts"]:
        assert r["kind"] == "signal" and r["cause"] == "killed by SIGKILL", r
        assert r["error"] is None and r["pid"] > 0
        assert 0 <= r["detected_after_s"] <= r["recovered_after_s"], r
        assert r["log"] == str(state / "logs" / f"{r['component']}.log")
    assert [{k: v for k, v in r.items() if k != "event"} for r in restarts] == summary["restarts"], \
        "the live log showed each restart as the report records it"
    assert summary["steps"] == steps and summary["staleness_violations"] == 0
    _assert_steps_intact(summary["per_step"], steps)
    _assert_ledger_intact(state, steps)


@pytest.mark.timeout(300)
def test_a_crash_looping_component_stops_the_job_naming_it_and_its_log(tmp_path: Path) -> None:
    """The parameter server's storage is replaced by a file: every restart dies at start-up. The
    stopped job leaves none of its component processes behind."""
    state = tmp_path / "run"
    proc = _spawn_up(state, "--steps", "200")
    ports: dict[str, int] = {}
    for event in _events(proc):
        if event["event"] == "component" and event["url"].startswith("http"):
            ports[event["name"]] = int(event["url"].rsplit(":", 1)[1])
        if event["event"] == "sample" and event["train_version"] >= 1:
            break
    job_file = str(state / "job.json")
    assert _pids_running(job_file), "the components run as processes"
    shutil.rmtree(state / "params")
    (state / "params").write_text("not a directory")
    os.kill(_pid_listening_on(ports["params"]), signal.SIGKILL)
    events = list(_events(proc))
    code = proc.wait(120)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 1, stderr
    assert _pids_running(job_file) == [], "orphan component processes"
    log = state / "logs" / "params.log"
    assert "params keeps failing" in stderr and str(log) in " ".join(stderr.split()), stderr
    assert "NotADirectoryError" in log.read_text(), "the log shows why it cannot start"
    end = events[-1]
    assert end["event"] == "end" and not end["completed"] and "params keeps failing" in end["failure"]
    summary = json.loads((state / "report-partial" / "summary.json").read_text())
    params = [r for r in summary["restarts"] if r["component"] == "params"]
    assert len(params) == 4, "the kill, then three restarts that died at start-up"
    assert params[0]["cause"] == "killed by SIGKILL" and params[-1]["error"].startswith("crash loop")
    assert all("exited with code" in r["cause"] for r in params[1:])
    assert "params keeps failing" in summary["failure"]


@pytest.mark.timeout(300)
def test_embedded_server_threads_that_stop_are_served_again(tmp_path: Path) -> None:
    """Embedded, the services are threads of the job's process: one whose server stops is served
    again at its port, and the run finishes intact."""
    config = JobConfig(engine="sim", workload="ci-tiny", max_tokens=48, instances=2, speed=20.0, steps=8,
                       ledger=LedgerConfig(eta=ETA, batch_size=BATCH, group_size=GROUP), state_dir=tmp_path / "run")
    job = LocalJob(config, fresh=True)
    job.write_planned_endpoints()
    stopped: list[str] = []
    try:
        job.start()
        assert job.supervisor is not None and job.pid("manager") is None, "embedded: the services are threads"
        restarted = threading.Event()
        job.supervisor.on_restarted.append(lambda name, t: restarted.set())
        with httpx.Client(timeout=10) as c:
            for name in ("ts", "manager"):
                while c.get(f"{job.endpoints['manager']['url']}/v1/buffers").json()["train_version"] < 2 * len(stopped) + 1:
                    job.stop.wait(0.1)  # polling pacing
                restarted.clear()
                job.servers[name].stop()  # its server thread ends, as if it had crashed
                stopped.append(name)
                assert restarted.wait(60), f"{name} was not served again"
        while not job.finished() and not job.stop.is_set():
            job.stop.wait(0.2)  # polling pacing
        assert job.failure is None, job.failure
        assert [(r["component"], r["kind"], r["pid"]) for r in job.restarts] == [("ts", "stopped", None),
                                                                             ("manager", "stopped", None)]
    finally:
        job.shutdown()
    _assert_steps_intact([asdict(s) for s in job.steps()], config.steps)
    _assert_ledger_intact(config.state_dir, config.steps)


@pytest.mark.timeout(300)
def test_a_start_that_fails_leaves_no_component_process_behind(tmp_path: Path) -> None:
    """Instances start side by side: when the first cannot start (its planned port is taken), the
    one launched beside it, not yet awaited, is stopped with the rest."""
    config = JobConfig(engine="sim", workload="ci-tiny", max_tokens=48, instances=2, speed=20.0, steps=2,
                       processes=True, ledger=LedgerConfig(eta=ETA, batch_size=BATCH, group_size=GROUP),
                       state_dir=tmp_path / "run")
    job = LocalJob(config, fresh=True)
    job.write_planned_endpoints()
    job_file = str(config.state_dir / "job.json")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", job.endpoints["inst-0"]["port"]))
        taken.listen()
        try:
            with pytest.raises(RuntimeError, match="component inst-0 exited with 1"):
                job.start()
            assert _pids_running(f"serve component inst-1 --job {job_file}"), "inst-1 was launched beside inst-0"
        finally:
            job.shutdown()
    assert _pids_running(job_file) == [], "orphan component processes"
