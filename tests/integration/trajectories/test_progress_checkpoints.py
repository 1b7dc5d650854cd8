"""Progress checkpoints over real HTTP on loopback: a sim instance checkpoints its running
trajectories to the trajectory server, which appends them durably; a trajectory handed back from a
failed instance resumes from its last checkpoint, after a restart of the trajectory server too."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from support import manager_config, train_buffer_zero

from staleflow.api.base import http_client
from staleflow.config import LedgerConfig
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

GROUP = 2
EVERY = 64  # progress_tokens of instance "a"
MAX_TOKENS = 4096


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


class Job:
    """Manager, trajectory server and two sim instances (virtual clock, long responses); ``a``
    checkpoints every ``EVERY`` tokens, ``b`` not at all."""

    def __init__(self, tmp_path: Path, stack: ExitStack, db_url: str | None):
        self.stack = stack
        manager_url = stack.enter_context(serve_in_thread(manager_app(
            manager_config(tmp_path, db_url, eta=1, batch_size=2, group_size=GROUP)))).url
        self.ts_config = TrajectoryServerConfig(
            ledger=LedgerConfig(eta=1, batch_size=2, group_size=GROUP), manager_url=manager_url,
            state_dir=tmp_path, db_url=db_url, reward="sim", sampling=SamplingConfig(max_tokens=MAX_TOKENS))
        self.ts_server = serve_in_thread(ts_app(self.ts_config)).__enter__()
        self.ts_url = self.ts_server.url
        self.ts = stack.enter_context(http_client(self.ts_url))
        self.manager_url = manager_url
        self.instances: dict[str, httpx.Client] = {}
        for name, every in (("a", EVERY), ("b", 0)):
            cfg = InstanceConfig(instance_id=name, sim=SimConfig(workload="paper-20k", kv_budget=10**7),
                                 completion_callback_url=f"{self.ts_url}/v1/completed",
                                 progress_url=f"{self.ts_url}/v1/progress", progress_tokens=every,
                                 progress_seconds=3600.0)
            self.instances[name] = stack.enter_context(http_client(stack.enter_context(
                serve_in_thread(instance_app(cfg))).url))
        self.commands = 0

    def restart_ts(self) -> None:
        """Stop the trajectory server and start a new one on the same database and port."""
        self.ts_server.stop()
        self.ts_server = serve_in_thread(ts_app(self.ts_config), port=int(self.ts_url.rsplit(":", 1)[1])).__enter__()

    def command(self, instance: str, **body: object) -> dict:
        self.commands += 1
        reply = self.instances[instance].post("/v1/commands", json={"command_id": f"c{self.commands}", **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def route(self, instance: str, traj_ids: list[str], v_traj: int) -> None:
        reply = self.ts.post("/v1/checkout", json={"instance_id": instance, "assignments": [
            {"traj_id": t, "v_traj": v_traj} for t in traj_ids]})
        assert reply.status_code == 200 and not reply.json()["refused"], reply.text
        self.command(instance, kind="route", trajectories=reply.json()["trajectories"])

    def stored(self, traj_id: str) -> dict:
        return self.ts.get(f"/v1/trajectories/{traj_id}").json()


@pytest.fixture
def job(tmp_path: Path, db_url: str | None):
    with ExitStack() as stack:
        j = Job(tmp_path, stack, db_url)
        try:
            yield j
        finally:
            j.ts_server.stop()


def a_group(job: Job) -> list[str]:
    pending = job.ts.get("/v1/pending").json()["trajectories"]
    group = pending[0]["group_id"]
    return [p["traj_id"] for p in pending if p["group_id"] == group]


def test_a_failed_instance_loses_at_most_one_checkpoint_interval(job: Job) -> None:
    members = a_group(job)
    job.route("a", members, v_traj=0)
    job.instances["a"].post("/v1/sim/advance", json={"by": 5.0}).raise_for_status()
    held = job.instances["a"].get("/v1/progress").json()["held"]
    assert all(held[t] >= EVERY for t in members), held
    # the checkpoints arrive on their own: each holds a multiple of EVERY tokens at most EVERY behind
    wait_for(lambda: all(job.stored(t)["generated"] > held[t] - EVERY for t in members))
    # and the instance took the replies
    wait_for(lambda: all(job.instances["a"].get("/v1/progress").json()["checkpointed"].get(t) == job.stored(t)[
        "generated"] for t in members))
    sent = job.instances["a"].get("/v1/progress").json()
    assert sent["checkpoints"] >= GROUP and sent["tokens"] == job.ts.get("/v1/health").json()["progress"][
        "checkpointed_tokens"] == sum(job.stored(t)["generated"] for t in members)
    checkpointed = {t: job.stored(t) for t in members}
    for t, stored in checkpointed.items():
        assert held[t] - EVERY < stored["generated"] <= held[t]
        assert stored["state"] == "routed" and stored["segments"] == [
            {"version": 0, "start": 0, "end": stored["generated"]}]

    # the trajectory server restarts: it adopts the checkpoints from its database
    job.restart_ts()
    for t in members:
        again = job.stored(t)
        assert again["tokens"] == checkpointed[t]["tokens"]
        assert again["logprobs"] == pytest.approx(checkpointed[t]["logprobs"], rel=1e-6)  # stored as float32

    # instance a fails: its trajectories go back to pending with their checkpoints, and resume on b
    assert job.ts.post("/v1/instances/a/release").json()["released"] == GROUP
    for t in members:
        assert job.stored(t)["state"] == "pending"
        assert job.stored(t)["tokens"] == checkpointed[t]["tokens"]
    assert job.ts.get("/v1/health").json()["progress"] == {
        "checkpointed_tokens": 0, "failed_over": GROUP,  # counted since the restart: no checkpoint since
        "resumed_tokens": sum(c["generated"] for c in checkpointed.values()),
        # how far a had got was said before the restart, to the server that stopped: nothing known to count
        "regenerated_trajectories": 0, "regenerated_tokens": 0}

    def route_and_run(traj_ids: list[str]) -> None:
        job.route("b", traj_ids, v_traj=0)
        job.instances["b"].post("/v1/sim/advance", json={"until_idle": True}).raise_for_status()

    train_buffer_zero(job.ts_url, job.manager_url, route_and_run, keep=job.stored(members[0])["group_id"])
    job.command("b", kind="pull", version=1)  # version 1 may exist now: buffer 0 was consumed
    job.route("b", members, v_traj=0)
    job.instances["b"].post("/v1/sim/advance", json={"until_idle": True}).raise_for_status()
    wait_for(lambda: all(job.stored(t)["state"] == "rewarded" for t in members))
    for t in members:
        done, cut = job.stored(t), checkpointed[t]["generated"]
        assert done["tokens"][:cut] == checkpointed[t]["tokens"], "the resumed response extends the checkpoint"
        assert done["segments"] == [{"version": 0, "start": 0, "end": cut},
                                    {"version": 1, "start": cut, "end": len(done["tokens"])}]
    # a late checkpoint from the failed instance changes nothing
    late = {"traj_id": members[0], "start": 0, "tokens": [1], "logprobs": [-0.5],
            "segments": [{"version": 0, "start": 0, "end": 1}]}
    assert job.ts.post("/v1/progress", json={"instance_id": "a", "trajectories": [late]}).json() == {
        "stored": {}, "ignored": [members[0]]}


def test_what_a_failed_instance_held_beyond_the_checkpoints_counts_as_regenerated(job: Job) -> None:
    first, second = a_group(job)

    def holds(traj_id: str) -> int:
        return job.instances["a"].get("/v1/progress").json()["held"].get(traj_id, 0)

    def advance_until(traj_id: str, tokens: int) -> None:  # the virtual clock, in steps of a few tokens
        while holds(traj_id) < tokens:
            job.instances["a"].post("/v1/sim/advance", json={"by": 0.05}).raise_for_status()

    job.route("a", [first], v_traj=0)
    job.instances["a"].post("/v1/sim/advance", json={"by": 5.0}).raise_for_status()  # one step: due once
    wait_for(lambda: job.stored(first)["generated"] == holds(first))  # checkpointed whole
    checkpointed = holds(first)
    advance_until(first, checkpointed + EVERY // 2)  # not due yet
    job.route("a", [second], v_traj=0)
    advance_until(first, checkpointed + EVERY)  # first is due, second (EVERY / 2 behind) is not
    wait_for(lambda: job.stored(first)["generated"] == holds(first))
    reached = holds(second)
    assert 0 < reached < EVERY and job.stored(second)["generated"] == 0, "second has no checkpoint"
    wait_for(lambda: job.stored(second)["held_on_instance"] == reached)  # a's word on how far second got

    # a fails: first lost nothing, second everything it had
    assert job.ts.post("/v1/instances/a/release").json()["released"] == GROUP
    progress = job.ts.get("/v1/health").json()["progress"]
    assert progress["resumed_tokens"] == job.stored(first)["generated"], "kept tokens are not regenerated ones"
    assert (progress["regenerated_trajectories"], progress["regenerated_tokens"]) == (1, reached)
    skew = job.ts.get("/v1/length-skew").json()
    assert sum(skew["regenerated_tokens"].values()) == reached
    assert f"staleflow_trajectory_failure_regenerated_tokens_total {float(reached)}" in job.ts.get("/metrics").text

    job.restart_ts()  # the count is durable
    assert job.ts.get("/v1/health").json()["progress"]["regenerated_tokens"] == reached


def test_checkpoints_out_of_bounds_are_refused_with_422(job: Job) -> None:
    members = a_group(job)
    job.route("b", members, v_traj=0)

    def post(**change: object) -> httpx.Response:
        item = {"traj_id": members[0], "start": 0, "tokens": [5, 6], "logprobs": [-0.1, -0.2],
                "segments": [{"version": 0, "start": 0, "end": 2}], **change}
        return job.ts.post("/v1/progress", json={"instance_id": "b", "trajectories": [item]})

    for bad in ({"logprobs": [-0.1]}, {"segments": [{"version": 0, "start": 0, "end": 3}]},
                {"tokens": [2**31, 1]}, {"logprobs": [0.5, -0.1]}, {"start": -1}):
        assert post(**bad).status_code == 422, bad
    assert job.stored(members[0])["generated"] == 0
    assert post().json() == {"stored": {members[0]: 2}, "ignored": []}
    assert post(start=1, tokens=[6, 7], logprobs=[-0.2, -0.3],
                segments=[{"version": 0, "start": 0, "end": 3}]).json()["stored"] == {members[0]: 3}
    gap = post(start=5, tokens=[8], logprobs=[-0.1], segments=[{"version": 0, "start": 0, "end": 6}])
    assert gap.json() == {"stored": {}, "ignored": [members[0]]}
    assert job.stored(members[0])["tokens"] == [5, 6, 7]


def test_what_the_coordinators_last_snapshot_saw_counts_as_regenerated_once_and_durably(job: Job) -> None:
    """Instance b sends no checkpoints and no word of its progress: what its trajectories held is
    known from the coordinator's snapshots alone, handed over when it declares b failed."""
    members = a_group(job)
    job.route("b", members, v_traj=0)
    job.instances["b"].post("/v1/sim/advance", json={"by": 5.0}).raise_for_status()
    generated = job.instances["b"].get("/v1/snapshot").json()["generated"]
    assert set(generated) == set(members) and all(n > 0 for n in generated.values()), generated
    assert all(job.stored(t)["generated"] == 0 for t in members)

    release = job.ts.post("/v1/instances/b/release", json={"generated": generated})
    assert release.json()["released"] == GROUP
    lost = sum(generated.values())
    progress = job.ts.get("/v1/health").json()["progress"]
    assert (progress["regenerated_trajectories"], progress["regenerated_tokens"]) == (GROUP, lost)
    assert f"staleflow_trajectory_failure_regenerated_tokens_total {float(lost)}" in job.ts.get("/metrics").text
    # a retried release (the coordinator's reply lost) counts nothing again
    assert job.ts.post("/v1/instances/b/release", json={"generated": generated}).json()["released"] == 0
    job.restart_ts()
    assert job.ts.get("/v1/health").json()["progress"]["regenerated_tokens"] == lost
