"""Lost messages never stall a job: the coordinator reconciles what the trajectory server has
routed with what the instances hold. Real manager, trajectory server, coordinator and sim
instances on loopback; the losses are real (a proxy that swallows completions, reads of the feed
far past its end, a Route sent behind the coordinator's back)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from support import manager_config

from staleflow.api.base import ServiceError, http_client
from staleflow.api.manager import ManagerClient
from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

ETA, BATCH, GROUP, STEPS = 1, 2, 2, 5


class LossyCallback:
    """Between the instances and the trajectory server: answers 200 to every completion batch,
    but forwards only some; the instances believe the swallowed ones delivered."""

    def __init__(self, ts_url: str, swallow: set[int]):
        self.swallow = swallow  # which batches (1, 2, ...) are lost
        self.batches = 0
        self.lost: list[str] = []
        self.app = FastAPI()
        self.app.post("/v1/completed")(self.completed)
        self.ts_url = ts_url

    async def completed(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.batches += 1
        if self.batches in self.swallow:
            self.lost += [item["trajectory"]["traj_id"] for item in body["items"]]
            return JSONResponse({"accepted": len(body["items"])})
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{self.ts_url}/v1/completed", json=body)
        return JSONResponse(reply.json(), status_code=reply.status_code)


@dataclass
class Job:
    manager: ManagerClient
    ts: httpx.Client
    coordinator: httpx.Client
    instances: dict[str, str]
    consumed: dict[str, int] = field(default_factory=dict)

    def train(self, steps: int, deadline_s: float = 120.0) -> None:
        """Consume ``steps`` buffers like a trainer; no group may be consumed twice."""
        deadline = time.monotonic() + deadline_s
        done = 0
        while done < steps:
            assert time.monotonic() < deadline, f"the job stalled after {done} steps: {self.ts.get('/v1/health').json()}"
            try:
                step = self.manager.consume()
            except ServiceError:
                time.sleep(0.02)  # a trainer polls for a Ready buffer
                continue
            assert self.ts.get(f"/v1/batches/{step.version}").status_code == 200
            self.ts.delete(f"/v1/batches/{step.version}")
            for group_id in step.group_ids:
                assert group_id not in self.consumed, f"group {group_id} consumed twice"
                self.consumed[group_id] = step.version
            done += 1

    def stats(self) -> dict:
        return self.coordinator.get("/v1/coordinator").json()


def start_job(stack: ExitStack, tmp_path: Path, callback: str | None = None, swallow: set[int] | None = None,
              names: tuple[str, ...] = ("a", "b"), reconcile_after: float = 1.0) -> tuple[Job, LossyCallback | None]:
    manager_url = stack.enter_context(serve_in_thread(manager_app(
        manager_config(tmp_path, eta=ETA, batch_size=BATCH, group_size=GROUP)))).url
    ts_url = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
        ledger=LedgerConfig(eta=ETA, batch_size=BATCH, group_size=GROUP), manager_url=manager_url,
        state_dir=tmp_path, reward="sim", sampling=SamplingConfig(max_tokens=32))))).url
    proxy = LossyCallback(ts_url, swallow) if swallow is not None else None
    callback = f"{stack.enter_context(serve_in_thread(proxy.app)).url}/v1/completed" if proxy else f"{ts_url}/v1/completed"
    instances = {}
    for name in names:
        config = InstanceConfig(instance_id=name, completion_callback_url=callback,
                                sim=SimConfig(workload="ci-tiny", clock="real", speed=20.0))
        instances[name] = stack.enter_context(serve_in_thread(instance_app(config))).url
    coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
        manager_url=manager_url, ts_url=ts_url, cycle_period=0.02, failure_timeout=5.0, reconcile_after=reconcile_after,
        instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()]))))
    job = Job(stack.enter_context(ManagerClient(manager_url)), stack.enter_context(http_client(ts_url)),
              stack.enter_context(http_client(coordinator.url)), instances)
    return job, proxy


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def test_a_job_finishes_when_completions_are_lost_on_the_way(tmp_path: Path, stack: ExitStack) -> None:
    """Swallowed completions leave trajectories routed to an instance that no longer runs them:
    without reconciliation the buffer they belong to never fills and the job stalls for good."""
    job, proxy = start_job(stack, tmp_path, swallow={1, 3, 4, 7})
    job.train(STEPS)
    assert proxy is not None and proxy.lost, "nothing was lost: the test proves nothing"
    assert job.stats()["reconciled"] >= 1


def test_reads_of_the_completed_feed_during_a_job_lose_nothing(tmp_path: Path, stack: ExitStack) -> None:
    """Anyone may read an instance's feed: reads far past its newest item once acknowledged
    completions the callback had not delivered yet, and froze the instance."""
    # a completion whose callback is still on its way after the grace period counts as missing: on a
    # loaded machine (every server here shares this process) that can take a second, so the grace is
    # long; a completion really lost still stalls the job past it, and is counted
    job, _ = start_job(stack, tmp_path, reconcile_after=10.0)
    stop = threading.Event()
    reads = [0]

    def read_far_ahead() -> None:
        with httpx.Client(timeout=10) as anyone:
            while not stop.is_set():
                for url in job.instances.values():
                    anyone.get(f"{url}/v1/completed", params={"after": 10**12, "limit": 1})
                    reads[0] += 1

    reader = threading.Thread(target=read_far_ahead, daemon=True)
    reader.start()
    try:
        job.train(STEPS)
    finally:
        stop.set()
        reader.join(15)
    assert reads[0] > 10
    stats = job.stats()
    assert stats["failures"] == 0 and stats["reconciled"] == 0, "nothing was lost, no instance froze"


def test_a_trajectory_run_behind_the_coordinators_back_is_aborted(tmp_path: Path, stack: ExitStack) -> None:
    job, _ = start_job(stack, tmp_path)
    stray = {"traj_id": "stray-0", "group_id": "nobody", "prompt_ids": [1, 2, 3], "v_traj": 0,
             "sampling": {"max_tokens": 100_000, "ignore_eos": True}}
    with http_client(job.instances["a"]) as a:
        routed = a.post("/v1/commands", json={"command_id": "behind-its-back", "kind": "route", "trajectories": [stray]})
        assert routed.status_code == 200, routed.text
        deadline = time.monotonic() + 60
        while "stray-0" in (snap := a.get("/v1/snapshot").json())["run_trajs"] + snap["wait_trajs"]:
            assert time.monotonic() < deadline, "the stray trajectory was never aborted"
            time.sleep(0.05)
    assert job.stats()["strays_aborted"] >= 1
    job.train(2)  # and the job goes on


def test_a_removed_instance_hands_its_trajectories_back(tmp_path: Path, stack: ExitStack) -> None:
    job, _ = start_job(stack, tmp_path, names=("a", "b", "c"))
    job.train(1)
    removed = job.coordinator.delete("/v1/instances/c")
    assert removed.status_code == 200 and removed.json()["instance_id"] == "c", removed.text
    assert removed.json()["released"] is not None
    assert "c" not in {i["instance_id"] for i in job.coordinator.get("/v1/instances").json()["instances"]}
    assert job.ts.get("/v1/routed", params={"instance_id": "c"}).json()["trajectories"] == []
    again = job.coordinator.delete("/v1/instances/c")
    assert again.status_code == 404 and again.json()["code"] == "unknown_instance"
    job.train(STEPS)


def test_instance_host_names_are_validated(tmp_path: Path, stack: ExitStack) -> None:
    job, _ = start_job(stack, tmp_path, names=("a",))
    for host in ("a" * 5000, "-leading-hyphen", "under_score", "a" * 64 + ".example.com", "a..b"):
        refused = job.coordinator.post("/v1/instances", json={"instance_id": "x", "url": f"http://{host}:8000"})
        assert refused.status_code == 422 and refused.json()["code"] == "invalid_request", (host, refused.text)
        assert len(refused.text) < 2000, "the refusal does not echo a huge host name back"
    for host in ("inst-1.rollout.svc.cluster.local", "10.0.0.7", "[fd00::7]"):
        url = f"http://{host}:8000"
        added = job.coordinator.post("/v1/instances", json={"instance_id": f"x{len(host)}", "url": url})
        assert added.status_code == 201, (host, added.text)
