"""Role-aware detection: a slow instance (long generations, every snapshot showing progress) is not
declared failed, while a hung one is: one that answers snapshots but makes no progress with work in
hand, and one that accepts connections but never answers. Virtual-clock sim instances: the test
moves the slow one's clock itself, so nothing depends on sleeps."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from support import manager_config

from staleflow.api.base import http_client
from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import bind_socket, serve_in_thread, url_for
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

# a loaded machine can leave a thread (the test's, moving the slow instance's clock) unscheduled for
# a second: the timeouts leave room for that, so only a really silent or stalled instance fails
FAILURE_TIMEOUT, STALL_TIMEOUT = 2.0, 3.0
LEDGER = {"eta": 1, "batch_size": 2, "group_size": 2}


def serve_job(stack: ExitStack, tmp_path: Path, names: tuple[str, ...]) -> tuple[str, str, dict[str, str]]:
    """A manager, a trajectory server and sim instances with long paper-like generations on a
    clock only the test moves: their URLs."""
    manager = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **LEDGER)))).url
    ts = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
        ledger=LedgerConfig(**LEDGER), manager_url=manager, state_dir=tmp_path, reward="sim",
        sampling=SamplingConfig(max_tokens=20_000))))).url
    urls = {name: stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
        instance_id=name, completion_callback_url=f"{ts}/v1/completed",
        sim=SimConfig(workload="paper-20k", clock="virtual", seed=1))))).url for name in names}
    return manager, ts, urls


def test_slow_instance_stays_live_hung_ones_are_declared_failed(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="staleflow.coordinator.service")
    with ExitStack() as stack:
        manager, ts, urls = serve_job(stack, tmp_path, ("slow", "stalled"))
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
        stalled.post("/v1/sim/advance", json={"by": 0.5}).raise_for_status()  # some tokens, then it stalls
        stalled_held = stalled.get("/v1/snapshot").json()["generated"]
        assert sum(stalled_held.values()) > 0, stalled_held
        first_running = set(slow.get("/v1/snapshot").json()["run_trajs"])
        started = time.monotonic()
        # long enough that silence or stalling would have been detected, both hung ones declared failed
        while time.monotonic() - started < STALL_TIMEOUT + FAILURE_TIMEOUT or \
                {statuses()["stalled"], statuses()["silent"]} != {"failed"}:
            assert time.monotonic() - started < 60, f"the hung instances were not detected: {statuses()}"
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
            # what it held (no checkpoints: all of it) is generated again, as the coordinator's snapshots saw it
            progress = t.get("/v1/health").json()["progress"]
            assert progress["regenerated_tokens"] == sum(stalled_held.values()), (progress, stalled_held)


class HangsFromItsFirstAbort:
    """In front of a real sim instance: forwards every request until the coordinator sends it an
    Abort, then answers nothing more, that Abort included, as if the instance process were
    SIGSTOPped between the snapshot the cycle planned from and the command it then waits on."""

    def __init__(self, instance_url: str) -> None:
        self.instance_url = instance_url
        self.hung = False
        self.unanswered: list[str] = []  # "METHOD path (kind)" of every request held
        self._release: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.app = FastAPI()
        self.app.api_route("/{path:path}", methods=["GET", "POST"])(self.forward)

    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        kind = json.loads(body).get("kind") if path == "v1/commands" and body else None
        if kind == "abort":
            self.hung = True
        if self.hung:
            self.unanswered.append(f"{request.method} /{path} ({kind})")
            if self._release is None:
                self._loop, self._release = asyncio.get_running_loop(), asyncio.Event()
            await self._release.wait()
            return JSONResponse({"detail": "the hung instance was let go"}, status_code=503)
        async with httpx.AsyncClient(base_url=self.instance_url, timeout=30) as client:
            reply = await client.request(request.method, f"/{path}", params=request.query_params, content=body,
                                         headers={"content-type": request.headers.get("content-type", "")})
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    def let_go(self) -> None:
        if self._loop is not None and self._release is not None:
            self._loop.call_soon_threadsafe(self._release.set)


def test_an_instance_hung_while_the_cycle_waits_on_its_command_is_failed_after_the_failure_timeout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cycle waits on the Interrupts and Aborts it issues. It used to wait up to the command
    timeout, so an instance that hung just then was declared failed only after that (30 s by
    default, against a 5 s failure timeout), and no instance got a snapshot or a command
    meanwhile. Here the command timeout is far beyond the test's patience: only the failure
    timeout can bound the verdict."""
    caplog.set_level(logging.WARNING, logger="staleflow.coordinator.service")
    with ExitStack() as stack:
        manager, ts, urls = serve_job(stack, tmp_path, ("a",))
        instance = urls["a"]
        front = HangsFromItsFirstAbort(instance)
        front_url = stack.enter_context(serve_in_thread(front.app)).url
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager, ts_url=ts, cycle_period=0.02, failure_timeout=FAILURE_TIMEOUT, stall_timeout=0,
            command_timeout=600.0, reconcile_after=0.2,
            instances=[InstanceEndpoint(instance_id="a", url=front_url)])))).url
        stack.callback(front.let_go)  # before the servers stop: nothing waits on the hung front then
        co = stack.enter_context(http_client(coordinator))

        def status() -> str:
            return co.get("/v1/instances/a").json()["status"]

        # a trajectory on the instance that the trajectory server never routed there: once the
        # grace period has passed, the cycle aborts it and waits for the answer
        stray = {"traj_id": "stray-0", "group_id": "nobody", "prompt_ids": [1, 2, 3], "v_traj": 0,
                 "sampling": {"max_tokens": 100, "ignore_eos": True}}
        with http_client(instance) as a:
            deadline = time.monotonic() + 30
            while status() == "joining":
                assert time.monotonic() < deadline, "the instance never joined"
                time.sleep(0.05)  # polling pacing
            routed = a.post("/v1/commands", json={"command_id": "behind-its-back", "kind": "route",
                                                  "trajectories": [stray]})
            assert routed.status_code == 200, routed.text
        deadline = time.monotonic() + 60  # far under the 600 s command timeout
        while status() != "failed":
            assert time.monotonic() < deadline, f"the hung instance was not declared failed: {front.unanswered}"
            time.sleep(0.05)  # polling pacing
        assert front.unanswered[0] == "POST /v1/commands (abort)", front.unanswered
        aborts = [c for c in co.get("/v1/commands").json()["commands"] if c["kind"] == "abort"]
        assert aborts and aborts[0]["outcome"].startswith("unknown"), aborts
        assert "a declared failed: no answer to abort for" in caplog.text, caplog.text
        assert co.get("/v1/coordinator").json()["failures"] == 1
