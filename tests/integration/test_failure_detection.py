"""Role-aware detection: a slow instance (long generations, every snapshot showing progress) is not
declared failed, while a hung one is: one that answers snapshots but makes no progress with work in
hand, and one that accepts connections but never answers. Virtual-clock sim instances: the test
moves the slow one's clock itself, so nothing depends on sleeps."""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from support import manager_config

from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.clients import http_client
from staleflow.servers.http import bind_socket, serve_in_thread, url_for
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

FAILURE_TIMEOUT, STALL_TIMEOUT = 1.0, 1.5
LEDGER = {"eta": 1, "batch_size": 2, "group_size": 2}


def test_slow_instance_stays_live_hung_ones_are_declared_failed(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="staleflow.coordinator.service")
    with ExitStack() as stack:
        manager = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **LEDGER)))).url
        ts = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
            ledger=LedgerConfig(**LEDGER), manager_url=manager, state_dir=tmp_path, reward="sim",
            sampling=SamplingConfig(max_tokens=20_000))))).url
        urls = {}
        for name in ("slow", "stalled"):  # long paper-like generations on a clock only the test moves
            urls[name] = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
                instance_id=name, completion_callback_url=f"{ts}/v1/completed",
                sim=SimConfig(workload="paper-20k", clock="virtual", seed=1))))).url
        silent = bind_socket("127.0.0.1", 0)  # listens, never accepts: requests queue unanswered
        stack.callback(silent.close)
        urls["silent"] = url_for(silent)
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager, ts_url=ts, cycle_period=0.02, failure_timeout=FAILURE_TIMEOUT,
            stall_timeout=STALL_TIMEOUT, command_timeout=FAILURE_TIMEOUT,
            instances=[InstanceEndpoint(instance_id=n, url=u) for n, u in urls.items()])))).url
        co = stack.enter_context(http_client(coordinator))
        slow = stack.enter_context(http_client(urls["slow"]))
        stalled = stack.enter_context(http_client(urls["stalled"]))

        def statuses() -> dict[str, str]:
            return {i["instance_id"]: i["status"] for i in co.get("/v1/instances").json()["instances"]}

        # both real instances join and get work; only "slow" ever moves its clock
        deadline = time.monotonic() + 30
        while not (slow.get("/v1/snapshot").json()["run_trajs"] and stalled.get("/v1/snapshot").json()["run_trajs"]):
            assert time.monotonic() < deadline, f"no work was routed: {statuses()}"
            slow.post("/v1/sim/advance", json={"by": 0.01})
        first_running = set(slow.get("/v1/snapshot").json()["run_trajs"])
        started = time.monotonic()
        # long enough that silence or stalling would have been detected twice over
        while time.monotonic() - started < 2 * (STALL_TIMEOUT + FAILURE_TIMEOUT) or statuses()["stalled"] != "failed":
            assert time.monotonic() - started < 30, f"the hung instances were not detected: {statuses()}"
            slow.post("/v1/sim/advance", json={"by": 0.01})  # a few tokens: progress, no completion
            seen = statuses()
            assert seen["slow"] != "failed", "a slow instance making progress was declared failed"
        seen = statuses()
        assert seen["stalled"] == "failed" and seen["silent"] == "failed" and seen["slow"] != "failed", seen
        still_running = set(slow.get("/v1/snapshot").json()["run_trajs"])
        assert first_running & still_running, "some generation on the slow instance outlived both timeouts"
        assert "stalled declared failed: no progress" in caplog.text
        assert "silent declared failed: no snapshot" in caplog.text
        assert "slow declared failed" not in caplog.text
        # the stalled instance's work went back to the trajectory server, to be routed again
        assert co.get("/v1/coordinator").json()["failures"] == 2
        with http_client(ts) as t:
            assert not t.get("/v1/routed", params={"instance_id": "stalled"}).json()["trajectories"]
