"""`staleflow up --launcher ray` on a Ray cluster as every cluster starts: three nodes with CPUs
only, no StaleFlow labels, no custom resources, no GPUs (``ray.cluster_utils.Cluster``, inside a
loopback-only network namespace, every Ray process bound to 127.0.0.1).

One sim job, started as a user starts it. While it starts, each control component is SIGKILLed as
soon as Ray reports it alive (the endpoints registry, the manager, the parameter server, the
reward server, the trajectory server, the coordinator), and the manager once more the moment
``endpoints.json`` appears, while the trainer is still starting. Ray restarts each like a
component that dies later, the start-up waits for them, and the job trains every step once,
within the staleness bound, placed by what the cluster has: the control services packed on one
node, nothing holding a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import yaml

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need Ray (the [ray] extra)")

from support.ray_cluster import (  # noqa: E402
    NODE,
    ClusterRun,
    RunningJob,
    local_ray_cluster,
    start_up,
    still_running,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NAMESPACE = "staleflow-ray-plain"
# every kill comes before the first step: enough steps that the job still runs while the first test
# reads its actors and placement groups (a few seconds after it started), no more
STEPS = 30
PLAIN_NODE = {**NODE, "num_cpus": 2}  # what `ray start` gives a 2-core machine: no GPU, no labels, no resources
KILLED_WHEN_ALIVE = ("endpoints", "manager", "params", "reward", "ts", "coordinator")  # the start order


@pytest.fixture(scope="module")
def plain_cluster() -> Iterator[ClusterRun]:
    with local_ray_cluster(NAMESPACE, PLAIN_NODE, [PLAIN_NODE, PLAIN_NODE]) as run:
        yield run


def alive_pid(name: str) -> int | None:
    """The pid of the job's actor ``name`` once Ray reports it alive (its constructor done)."""
    from ray._private import state

    view = state.actors(actor_id=ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex())
    return view["Pid"] if view["State"] == "ALIVE" and view["Pid"] else None


def num_restarts(name: str) -> int:
    from ray._private import state

    return state.actors(actor_id=ray.get_actor(name, namespace=NAMESPACE)._actor_id.hex())["NumRestarts"]


@dataclass
class Kills:
    done: list[dict] = field(default_factory=list)
    error: str | None = None
    bundles: list[dict] = field(default_factory=list)  # what the job's placement groups asked for, once it started


def kill_during_start_up(job: RunningJob, kills: Kills) -> None:
    """SIGKILL each control component as soon as it is alive, then the manager again as soon as
    ``endpoints.json`` appears; note whether the job had finished starting (its trainer event)."""
    try:
        for name in KILLED_WHEN_ALIVE:
            pid = wait_for(lambda name=name: alive_pid(name), 240, f"{name} alive", pace=0.01)
            os.kill(pid, signal.SIGKILL)
            kills.done.append({"name": name, "pid": pid, "started": job.event("component", "trainer") is not None})
        wait_for(lambda: (job.state / "endpoints.json").exists(), 240, "endpoints.json written", pace=0.01)
        pid = wait_for(lambda: alive_pid("manager"), 120, "the manager alive again", pace=0.01)
        os.kill(pid, signal.SIGKILL)
        kills.done.append({"name": "manager", "pid": pid, "started": job.event("component", "trainer") is not None})
    except BaseException as exc:  # reported by the test
        kills.error = repr(exc)


@pytest.fixture(scope="module")
def killed_job(plain_cluster: ClusterRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningJob, Kills]]:
    tmp = tmp_path_factory.mktemp("plain-job")
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump({
        "engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2, "steps": STEPS, "speed": 20,
        "ledger": {"eta": 1, "batch_size": 4, "group_size": 2},
        "cluster": {"address": plain_cluster.cluster.address, "namespace": NAMESPACE}}))  # no selectors, no GPU counts
    running = start_up(tmp, config, tmp / "state")
    kills = Kills()
    killer = threading.Thread(target=kill_during_start_up, args=(running, kills), daemon=True)
    killer.start()
    try:
        yield running, kills
    finally:
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                running.proc.wait(60)
        if running.proc.poll() is None:
            running.proc.kill()


@pytest.mark.timeout(900)
def test_a_control_component_killed_during_start_up_is_restarted_and_the_job_starts(
        killed_job: tuple[RunningJob, Kills]) -> None:
    job, kills = killed_job
    wait_for(lambda: job.event("component", "trainer") or job.proc.poll() is not None or kills.error, 480,
             "the job started")
    assert kills.error is None, kills.error
    assert job.proc.poll() is None, "".join(job.output[-60:])
    assert [k["name"] for k in kills.done] == [*KILLED_WHEN_ALIVE, "manager"]
    assert not any(k["started"] for k in kills.done), f"every kill came while the job was starting: {kills.done}"
    for name in KILLED_WHEN_ALIVE:  # Ray restarted each (the manager twice), as a component that dies later
        assert num_restarts(name) >= (2 if name == "manager" else 1), name
        assert alive_pid(name) not in {k["pid"] for k in kills.done if k["name"] == name}
    kills.bundles = [b for g in ray.util.placement_group_table().values() if g.get("name", "").startswith(NAMESPACE)
                     for b in g["bundles"].values()]


@pytest.mark.timeout(600)
def test_it_places_by_what_the_cluster_has(killed_job: tuple[RunningJob, Kills]) -> None:
    job, kills = killed_job
    placement = wait_for(lambda: json.loads((job.state / "placement.json").read_text()), 120, "placement.json")
    services = {n: placement[n] for n in ("manager", "params", "reward", "ts", "coordinator")}
    assert len({s["node_id"] for s in services.values()}) == 1, f"the control services on one node: {services}"
    assert {*placement} >= {"inst-0", "inst-1", "trainer-0"}
    assert all(not p["gpu_ids"] for p in placement.values()), f"a sim job holds no GPU: {placement}"
    cluster_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {p["node_id"] for p in placement.values()} <= cluster_nodes
    assert len(kills.bundles) == 6 + 2 + 1, "control services and registry, two instances, one trainer node"
    assert all(set(b) == {"CPU"} for b in kills.bundles), f"CPU only, no custom resource: {kills.bundles}"


@pytest.mark.timeout(900)
def test_the_job_finishes_every_step_trained_once(killed_job: tuple[RunningJob, Kills]) -> None:
    job, _ = killed_job
    job.proc.wait(600)
    end = job.event("end")
    assert job.proc.returncode == 0 and end is not None, "".join(job.output[-60:])
    assert end["completed"] and end["staleness_violations"] == 0, end
    steps = [json.loads(line) for line in (job.state / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert sorted({s["version"] for s in steps}) == list(range(STEPS)), [s["version"] for s in steps]
    assert all(0 <= int(k) <= 1 for s in steps for k in s["staleness"]), "within the staleness bound (eta 1)"
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def test_teardown_leaves_no_ray_process(plain_cluster: ClusterRun) -> None:
    ran = plain_cluster.stop()
    assert ran, "the cluster's processes were this process's children"
    wait_for(lambda: not still_running(ran), 30, "every process of the cluster exits")

