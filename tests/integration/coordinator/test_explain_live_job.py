"""Asking a live job why a buffer waits, over real HTTP on loopback: a manager, a trajectory server,
two sim instances on virtual clocks (nothing moves until the test advances them) and a coordinator
routing to them; the answer must name the groups the ledger holds in the buffer and the instances
the trajectory server routed their trajectories to, at the progress the instances report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
from support import manager_and_trajectory_server, manager_config
from typer.testing import CliRunner

from staleflow.api.base import http_client
from staleflow.cli.main import app
from staleflow.config.strategy import MigrationMode, StrategyConfig
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app

ETA, BATCH, GROUP, MAX_TOKENS = 1, 2, 2, 4096


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
    return value


def test_a_live_job_says_which_groups_a_buffer_waits_for_and_where_they_run(tmp_path: Path) -> None:
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, tmp_path, MAX_TOKENS, eta=ETA, batch_size=BATCH,
                                                            group_size=GROUP)
        instances: dict[str, httpx.Client] = {}
        endpoints = []
        for name in ("a", "b"):
            url = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
                instance_id=name, sim=SimConfig(workload="paper-20k", kv_budget=10**7),
                completion_callback_url=f"{ts_url}/v1/completed")))).url
            instances[name] = stack.enter_context(http_client(url))
            endpoints.append(InstanceEndpoint(instance_id=name, url=url))
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, cycle_period=0.02, instances=endpoints,
            strategy=StrategyConfig(migration=MigrationMode.NONE)))))
        co = stack.enter_context(http_client(coordinator.url))
        ts = stack.enter_context(http_client(ts_url))
        manager = stack.enter_context(http_client(manager_url))

        # the ledger admits C * (eta + 1) = 4 groups; wait until all their members run on the instances
        def settled() -> dict | None:
            routed = ts.get("/v1/routed").json()["trajectories"]
            running = {n: set(c.get("/v1/snapshot").json()["run_trajs"]) for n, c in instances.items()}
            seen = {i["instance_id"]: set((i["snapshot"] or {}).get("run_trajs") or [])
                    for i in co.get("/v1/instances").json()["instances"]}
            if len(routed) == 4 * GROUP and seen == running and all(
                    t["traj_id"] in running[t["instance_id"]] for t in routed):
                return {t["traj_id"]: t["instance_id"] for t in routed}
            return None

        where = wait_for(settled)
        assert isinstance(where, dict)
        reserved = {e["group_id"] for b in manager.get("/v1/buffers").json()["buffers"] for e in b["entries"]
                    if e["status"] == "reserved"}
        assert len(reserved) == 4

        answer = co.get("/v1/buffers/0/explain").json()
        assert answer["state"] == "stuck" and not answer["consumable"]
        assert answer["needed"] == BATCH and answer["unreserved"] == 0
        # every group's window reaches buffer 1: the two of the four expected to finish first fill buffer 0
        named = {g["group_id"] for g in answer["groups"]}
        assert len(named) == BATCH and named <= reserved, "groups the ledger holds, as many as it needs"
        assert not any(g["required"] for g in answer["groups"])
        for group in answer["groups"]:
            assert len(group["trajectories"]) == GROUP and group["needed"] == GROUP
            for t in group["trajectories"]:
                assert t["instance_id"] == where[t["traj_id"]], "routed where the trajectory server says"
                assert t["where"] == f"running on {where[t['traj_id']]}"
                assert t["max_tokens"] == MAX_TOKENS and t["ready_in_s"] > 0
            assert group["ready_in_s"] == max(t["ready_in_s"] for t in group["trajectories"])
        assert answer["ready_in_s"] == sorted(g["ready_in_s"] for g in answer["groups"])[BATCH - 1]
        assert "expected ready in" in answer["summary"]

        # the command line asks the same live job (the head buffer by default)
        runner = CliRunner()
        cli = ["--url", manager_url, "--coordinator-url", coordinator.url, "--state-dir", str(tmp_path)]
        as_json = runner.invoke(app, ["buffers", "--why", "--json", *cli])
        assert as_json.exit_code == 0, as_json.output
        assert {g["group_id"] for g in json.loads(as_json.output)["groups"]} == named
        table = runner.invoke(app, ["buffers", "--why", "0", *cli], env={"COLUMNS": "250"})
        assert table.exit_code == 0, table.output
        assert "buffer 0 is stuck" in table.output and "expected ready in" in table.output
        for group in named:
            assert group in table.output
        for instance_id in {where[t["traj_id"]] for g in answer["groups"] for t in g["trajectories"]}:
            assert f"running on {instance_id}" in table.output
        gone = runner.invoke(app, ["buffers", "--why", "9", *cli])
        assert gone.exit_code == 2 and "not live yet" in gone.output and "staleflow buffers" in gone.output

        # one instance generates for a while (virtual time): the answer follows its progress
        before = {t["traj_id"]: t for g in answer["groups"] for t in g["trajectories"]}
        mover = where[next(iter(before))]
        instances[mover].post("/v1/sim/advance", json={"by": 1.0})
        held = instances[mover].get("/v1/progress").json()["held"]

        def moved_on(answer: dict) -> list[str]:
            return [t["traj_id"] for g in answer["groups"] for t in g["trajectories"] if where[t["traj_id"]] == mover]

        def caught_up() -> dict | None:
            later = co.get("/v1/buffers/0/explain").json()
            moved = moved_on(later)
            return later if moved and all(
                t["generated"] == held[t["traj_id"]] for g in later["groups"] for t in g["trajectories"]
                if t["traj_id"] in moved) else None

        later = wait_for(caught_up)
        assert isinstance(later, dict)
        now = {t["traj_id"]: t for g in later["groups"] for t in g["trajectories"]}
        moved = moved_on(later)
        assert all(held[traj] > 0 for traj in moved)
        for traj in set(moved) & set(before):
            assert now[traj]["ready_in_s"] < before[traj]["ready_in_s"], "closer to done"
        for traj in set(now) - set(moved):
            assert now[traj]["generated"] == 0, "the other instance's clock did not move"

        # both instances run their trajectories to the end: the buffer becomes consumable, then consumed
        for client in instances.values():
            client.post("/v1/sim/advance", json={"until_idle": True})
        ready = wait_for(lambda: (a := co.get("/v1/buffers/0/explain").json())["consumable"] and a)
        assert isinstance(ready, dict)
        assert ready["state"] == "ready" and ready["needed"] == 0 and ready["groups"] == []
        assert "can consume it now" in ready["summary"]
        consumed = manager.post("/v1/consume", params={"version": 0}).json()
        after = co.get("/v1/buffers/0/explain").json()
        assert after["state"] == "consumed" and not after["consumable"] and after["occupied"] == len(consumed["group_ids"])
        assert after["summary"] == (f"buffer 0 was already consumed: the trainer trained on its {BATCH} groups and is "
                                    "now at version 1, waiting for buffer 1"), "a whole sentence"

        # without a version the command explains the buffer the trainer waits for, even when the one it read
        # was consumed meanwhile (here: a manager still at version 0 answers the read, as a read just before
        # the consume would have)
        stale = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path / "stale", eta=ETA,
                                                                               batch_size=BATCH, group_size=GROUP))))
        next_one = runner.invoke(app, ["buffers", "--why", "--url", stale.url, "--coordinator-url", coordinator.url,
                                       "--state-dir", str(tmp_path)], env={"COLUMNS": "80"})
        assert next_one.exit_code == 0, next_one.output
        assert next_one.output.startswith("buffer 1 is ") and "consumed" not in next_one.output
        as_json = runner.invoke(app, ["buffers", "--why", "--json", "--url", stale.url, "--coordinator-url",
                                      coordinator.url, "--state-dir", str(tmp_path)])
        assert json.loads(as_json.output)["version"] == 1

        # a buffer that is not live: the one error shape, with its code
        unknown = co.get("/v1/buffers/7/explain")
        assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_buffer"
        assert "live buffers are 1..2" in unknown.json()["detail"]
        assert co.get("/v1/buffers/-1/explain").status_code == 422
