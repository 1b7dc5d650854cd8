"""`staleflow up --launcher ray` on a local multi-node Ray cluster.

One cluster for the module (``ray.cluster_utils.Cluster``): a head that runs nothing of StaleFlow,
a control node (marked for the role by its label and custom resource) and a node with four fake
GPUs carrying the rollout and trainer resources; the node-loss test adds a second such node and removes the
first. Everything runs inside a loopback-only network namespace this module creates (Ray would
otherwise probe public DNS to learn its address), every Ray process bound to 127.0.0.1.

One sim job, started as a user starts it, runs through the tests in file order: placement,
discovery from a second process, SIGKILL of each role's actor process, the loss of a node, the job
finishing with nothing lost or consumed twice and no bound violated, every restart recorded by
the job's supervisor as on a local run. Then a job whose parameter server keeps dying at start-up
is stopped as a crash loop, a job whose driver dies (its detached actors keep serving) is taken
over or removed with ``staleflow down``, an infeasible plan fails fast, and the cluster's
teardown leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
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

NAMESPACE = "staleflow-ray-e2e"
SERVICES = ("manager", "params", "reward", "ts", "coordinator")
INSTANCES = ("inst-0", "inst-1")
GPU_NODE = {**NODE, "num_cpus": 2, "num_gpus": 4, "resources": {"staleflow_rollout": 1, "staleflow_trainer": 1}}
TIMINGS = Path(os.environ.get("STALEFLOW_RAY_TIMINGS", "/tmp/staleflow-ray-fault-timings.json"))


@dataclass
class LocalCluster:
    run: ClusterRun
    control: Any
    gpu: Any

    @property
    def cluster(self) -> Any:
        return self.run.cluster

    def stop(self) -> list[int]:
        return self.run.stop()


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    head = {**NODE, "num_cpus": 0,
            # a lost node is declared dead after 3 missed checks 0.5 s apart (default: ~16 s)
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}}
    control = {**NODE, "num_cpus": 1, "resources": {"staleflow_control": 1}, "labels": {"staleflow.io/role": "control"}}
    with local_ray_cluster(NAMESPACE, head, [control, GPU_NODE]) as run:
        yield LocalCluster(run, *run.nodes)


# the module's job trains through every fault and the node loss: they were over by step 101-112 in
# runs at load 3 to 8 on 2 cores (the first fault comes at step 25-37); 200 steps leave room
def job_file(tmp: Path, cluster: Any, namespace: str, **overrides: Any) -> Path:
    data = {"engine": "sim", "workload": "ci-tiny", "max_tokens": 48, "instances": 2, "steps": 200, "speed": 20,
            "ledger": {"eta": 1, "batch_size": 4, "group_size": 2},
            "cluster": {"address": cluster.address, "namespace": namespace, "ps_relay": "per_rollout_node",
                        "rollout": {"resource": "staleflow_rollout"}, "trainer": {"resource": "staleflow_trainer"},
                        "gpus_per_instance": 1, "gpus_per_rank": 1,  # a sim job asks for none unless told
                        # the node the loss test removed rejoins slowly on two busy cores
                        "placement_timeout_s": 180},
            **overrides}
    path = tmp / f"{namespace}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def job(local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningJob]:
    tmp = tmp_path_factory.mktemp("ray-job")
    running = start_up(tmp, job_file(tmp, local_cluster.cluster, NAMESPACE), tmp / "state")
    try:
        wait_for(lambda: running.event("component", "trainer") or running.proc.poll() is not None, 240,
                 "every component of the job started")
        assert running.proc.poll() is None, "".join(running.output)
        yield running
    finally:
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                running.proc.wait(60)
        if running.proc.poll() is None:
            running.proc.kill()


def actor(name: str, namespace: str = NAMESPACE) -> Any:
    return ray.get_actor(name, namespace=namespace)


def where(name: str, namespace: str = NAMESPACE) -> dict:
    """Where a component runs now: pid, node, GPUs, URL (from the actor itself)."""
    handle = actor(name, namespace)
    return ray.get((handle.state if name.startswith("trainer-") else handle.info).remote(), timeout=120)


def registry(namespace: str = NAMESPACE) -> dict:
    return ray.get(actor("endpoints", namespace).get.remote(), timeout=30)


def get_json(url: str, path: str) -> dict:
    with httpx.Client(base_url=url, timeout=3) as client:
        reply = client.get(path)
        reply.raise_for_status()
        return reply.json()


def train_version() -> int:
    return get_json(registry()["manager"]["url"], "/v1/buffers")["train_version"]


def coordinator_instances() -> dict[str, dict]:
    return {i["instance_id"]: i for i in get_json(registry()["coordinator"]["url"], "/v1/instances")["instances"]}


def step_count(running: RunningJob) -> int:
    path = running.state / "trainer" / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def ray_view(name: str) -> dict:
    """Ray's own record of the actor now holding ``name`` (State, NumRestarts, Pid)."""
    from ray._private import state

    return state.actors(actor_id=actor(name)._actor_id.hex())


def died(name: str, old: dict) -> bool:
    view = ray_view(name)
    return view["State"] != "ALIVE" or view["NumRestarts"] > old["NumRestarts"] or view["Pid"] != old["Pid"]


# ---------------------------------------------------------------------------- the tests


@pytest.mark.timeout(600)  # the module's cluster and job start with the first test
def test_placement_puts_each_role_on_its_nodes(local_cluster: LocalCluster, job: RunningJob) -> None:
    control, gpu, head = local_cluster.control.node_id, local_cluster.gpu.node_id, local_cluster.cluster.head_node.node_id
    services = {name: where(name) for name in SERVICES}
    assert {s["node_id"] for s in services.values()} == {control}, services
    instances = {name: where(name) for name in INSTANCES}
    trainer = where("trainer-0")
    assert {i["node_id"] for i in instances.values()} == {gpu} and trainer["node_id"] == gpu
    gpu_ids = [g for i in instances.values() for g in i["gpu_ids"]] + trainer["gpu_ids"]
    assert len(gpu_ids) == 3 and len(set(gpu_ids)) == 3, f"instances and trainer share GPUs: {gpu_ids}"
    relay = where("relay-0")
    assert relay["node_id"] == gpu, "the parameter-server relay sits on the rollout node"
    wait_for(lambda: get_json(relay["url"], "/v1/params/latest")["version"] >= 1, 120, "the relay mirrors versions")
    assert {i: c["params_url"] for i, c in coordinator_instances().items()} == {i: relay["url"] for i in INSTANCES}, \
        "each instance's Pull names the relay on its node"
    nodes_used = {i["node_id"] for i in [*services.values(), *instances.values(), trainer, relay]}
    assert head not in nodes_used, "nothing of StaleFlow runs on the head node"
    published = json.loads((job.state / "endpoints.json").read_text())
    assert published["launcher"] == "ray" and published["namespace"] == NAMESPACE
    assert {k: v for k, v in published.items() if k in registry()} == registry()
    low, high = 20000, 29999
    assert all(low <= e["port"] <= high for e in registry().values()), "ports come from cluster.port_range"


def test_a_second_process_finds_the_job_by_its_namespace(local_cluster: LocalCluster, job: RunningJob,
                                                         tmp_path: Path) -> None:
    def cli(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "staleflow.cli", *args, "--launcher", "ray", "--namespace", NAMESPACE,
                              "--ray-address", local_cluster.cluster.address, "--json"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,  # no state dir there
                             env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    status = cli("status")
    assert set(status) == {*SERVICES, *INSTANCES, "relay-0"} and all(row["up"] for row in status.values()), status
    assert {i["instance_id"] for i in cli("instances")["instances"]} == set(INSTANCES)
    assert cli("buffers")["train_version"] >= 0


ROLE_ORDER = ("inst-0", "ts", "params", "manager", "reward", "coordinator", "trainer-0", "inst-1 (hung)", "params (hung)")
HUNG_CAUSES = {"inst-1": "the coordinator declared it failed", "params": "3 health probes failed in a row"}


def supervised(name: str) -> str:
    """The component a role's actor belongs to, as the supervisor names it (the ranks: the trainer gang)."""
    return "trainer" if name.startswith("trainer-") else name


def restart_events(running: RunningJob, name: str) -> list[dict]:
    return [e for e in running.events if e["event"] == "restart" and e["component"] == supervised(name)]
TRAINER_RESTARTS = 2  # its SIGKILL above and the loss of its node


@pytest.mark.timeout(900)
def test_each_role_killed_or_hung_recovers_in_place(job: RunningJob) -> None:
    timings: dict[str, dict] = {}
    for role in ROLE_ORDER:
        name, hung = role.split(" ")[0], role.endswith("(hung)")
        before = wait_for(lambda: train_version() >= 1 and train_version(), 120, f"training progresses before {name}")
        wait_for(lambda: train_version() > before, 120, f"a step trained before killing {name}")
        old = where(name)
        seen = ray_view(name)
        assert seen["Pid"] == old["pid"]
        url = registry().get(name, {}).get("url")
        steps_before = step_count(job)
        recorded = len(restart_events(job, name))
        killed_at = time.monotonic()
        if hung and name.startswith("inst-"):  # alive to Ray: the coordinator's verdict, then the launcher, end it
            os.kill(old["pid"], signal.SIGSTOP)
            wait_for(lambda: coordinator_instances()[name]["status"] == "failed", 120, f"{name} declared failed")
        elif hung:  # alive to Ray: the launcher's health probe finds it and kills it
            os.kill(old["pid"], signal.SIGSTOP)
            wait_for(lambda: died(name, seen), 120, f"the launcher ends the hung {name}", pace=0.01)
        else:
            os.kill(old["pid"], signal.SIGKILL)
            # services and instances: Ray restarts the actor; trainer ranks: the launcher restarts the gang
            wait_for(lambda: died(name, seen), 60, f"Ray sees {name} die", pace=0.01)
        detected = time.monotonic() - killed_at
        new = wait_for(lambda: (w := where(name))["pid"] != old["pid"] and w, 120, f"{name} restarted")
        restarted = time.monotonic() - killed_at
        if name.startswith("trainer-"):
            wait_for(lambda: step_count(job) > steps_before, 180, "the restarted trainer trains a step")
        elif name.startswith("inst-"):
            assert new["url"] == url, f"{name} came back on its node at another URL"
            wait_for(lambda: coordinator_instances()[name]["status"] == "live", 120, f"{name} live again")
        else:
            assert new["url"] == url, f"{name} came back on its node at another URL"
            wait_for(lambda: get_json(url, "/v1/health"), 120, f"{name} answers")
            if name == "coordinator":
                wait_for(lambda: all(i["status"] in ("live", "syncing") for i in coordinator_instances().values()),
                         120, "the restarted coordinator adopts every instance")
        timings[role] = {"detection_s": round(detected, 2), "restarted_s": round(restarted, 2),
                         "recovery_s": round(time.monotonic() - killed_at, 2)}
        # the supervisor saw it, once, and recorded it as it records a local restart (--json-log)
        record = wait_for(lambda: len(restart_events(job, name)) > recorded and restart_events(job, name)[-1],
                          60, f"the supervisor recorded {name}'s restart")
        assert len(restart_events(job, name)) == recorded + 1, f"one restart of {name}: {restart_events(job, name)}"
        assert record["kind"] == ("hung" if hung else "exit"), record
        cause = HUNG_CAUSES[name] if hung else "a trainer rank died" if name.startswith("trainer-") else "its process died"
        assert cause in record["cause"], record
        assert record["error"] is None and record["recovered_after_s"] >= record["detected_after_s"] >= 0, record
        assert record["pid"] == new["pid"] and record["log"] == str(job.state / "logs" / f"{name}.log"), record
    TIMINGS.write_text(json.dumps(timings, indent=2))
    print("\nper-role detection and recovery under --launcher ray (s):", json.dumps(timings))
    assert job.proc.poll() is None, "the job kept running through every fault"


@pytest.mark.timeout(600)
def test_loss_of_a_node_moves_its_work(local_cluster: LocalCluster, job: RunningJob) -> None:
    replacement = local_cluster.cluster.add_node(**GPU_NODE)
    local_cluster.cluster.wait_for_nodes()
    lost = local_cluster.gpu.node_id
    victims = [where(n) for n in (*INSTANCES, "trainer-0", "relay-0")]
    assert all(v["node_id"] == lost for v in victims)
    old_urls = {n: registry()[n]["url"] for n in INSTANCES}
    local_cluster.cluster.remove_node(local_cluster.gpu, allow_graceful=False)
    for v in victims:  # the node's processes die with it (removing the raylet alone leaves them running)
        with contextlib.suppress(ProcessLookupError):
            os.kill(v["pid"], signal.SIGKILL)
    local_cluster.gpu = replacement
    lost_at = time.monotonic()
    for name in INSTANCES:
        moved = wait_for(lambda: (w := where(name))["node_id"] == replacement.node_id and w, 180, f"{name} moved")
        assert moved["url"] != old_urls[name], "a moved instance serves at a new address"
        wait_for(lambda: registry()[name]["url"] == moved["url"], 60, f"the registry knows where {name} went")
        wait_for(lambda: (c := coordinator_instances()[name])["url"] == moved["url"] and c["status"] == "live", 120,
                 f"{name} re-registered with the coordinator")
    wait_for(lambda: where("trainer-0")["node_id"] == replacement.node_id, 180, "the trainer gang restarted on the new node")
    relay = wait_for(lambda: (w := where("relay-0"))["node_id"] == replacement.node_id and w, 180, "the relay moved")
    wait_for(lambda: all(c["params_url"] == relay["url"] for c in coordinator_instances().values()), 120,
             "the moved instances pull from the moved relay")
    steps = step_count(job)
    wait_for(lambda: step_count(job) > steps, 180, "training goes on after the node loss")
    print(f"\nnode loss: instances and trainer back on the new node, training again {time.monotonic() - lost_at:.1f} s "
          "after the node was removed")


@pytest.mark.timeout(900)
def test_the_job_finishes_with_nothing_lost_or_consumed_twice(job: RunningJob) -> None:
    job.proc.wait(600)
    end = job.event("end")
    assert job.proc.returncode == 0 and end is not None, "".join(job.output[-40:])
    assert end["completed"] and end["staleness_violations"] == 0, end
    config = yaml.safe_load(job.config.read_text())
    steps = [json.loads(line) for line in (job.state / "trainer" / "steps.jsonl").read_text().splitlines()]
    first_tries: dict[int, dict] = {}
    for s in steps:  # a restarted trainer retrains the step whose version was not yet visible: same batch
        first = first_tries.setdefault(s["version"], s)
        assert (s["groups"], s["response_tokens"]) == (first["groups"], first["response_tokens"]), (first, s)
    assert sorted(first_tries) == list(range(config["steps"])), f"every version trained: {sorted(first_tries)}"
    versions = [s["version"] for s in steps]
    assert all(b <= a + 1 for a, b in zip(versions, versions[1:], strict=False)), f"in order: {versions}"
    assert len(steps) - len(first_tries) <= TRAINER_RESTARTS, f"a step retrained per trainer restart at most: {versions}"
    ledger = config["ledger"]
    for s in steps:
        assert s["trajectories"] == s["groups"] * ledger["group_size"]
        assert all(0 <= int(k) <= ledger["eta"] for k in s["staleness"]), s["staleness"]
    db = sqlite3.connect(job.state / "ledger.db")
    try:
        consumed: list[str] = []
        for (detail,) in db.execute("SELECT detail FROM ledger_events WHERE op = 'consume' ORDER BY id"):
            consumed += json.loads(detail).get("consumed") or []
        late = db.execute("SELECT COUNT(*) FROM ledger_retired WHERE fate = 'consumed' AND "
                          "(buffer - v_traj < 0 OR buffer - v_traj > ?)", (ledger["eta"],)).fetchone()[0]
    finally:
        db.close()
    assert len(consumed) == len(set(consumed)) == config["steps"] * ledger["batch_size"], "every group consumed once"
    assert late == 0, "every consumed group within the staleness bound"
    summary = json.loads((job.state / "report" / "summary.json").read_text())
    assert summary["restarts"] == [{k: v for k, v in e.items() if k != "event"} for e in job.events
                                   if e["event"] == "restart"], "the report holds the restarts the live log showed"
    recorded = {supervised(role.split(" ")[0]) for role in ROLE_ORDER}
    assert recorded <= {r["component"] for r in summary["restarts"]}, summary["restarts"]
    assert all(r["error"] is None and r["recovered_after_s"] is not None for r in summary["restarts"]), summary["restarts"]
    assert end["restarts"] == len(summary["restarts"]) and "failure" not in summary
    assert not ray.util.list_named_actors(all_namespaces=True), "the finished job removed its actors"


@pytest.mark.timeout(600)
def test_a_crash_looping_component_stops_the_job_naming_it_and_its_log(local_cluster: LocalCluster,
                                                                       tmp_path: Path) -> None:
    """The parameter server's storage is replaced by a file: every restart Ray makes dies at start-up.
    The supervisor's crash-loop rule, the same as on a local run, stops the job."""
    namespace = "staleflow-ray-e2e-crash-loop"
    config = job_file(tmp_path, local_cluster.cluster, namespace, steps=1000,
                      supervision={"max_restarts": 1, "restart_window_s": 600})
    state = tmp_path / "state"
    looping = start_up(tmp_path, config, state)
    try:
        wait_for(lambda: looping.event("component", "trainer") or looping.proc.poll() is not None, 240, "the job started")
        assert looping.proc.poll() is None, "".join(looping.output)
        shutil.rmtree(state / "params")
        (state / "params").write_text("not a directory")
        os.kill(where("params", namespace)["pid"], signal.SIGKILL)
        code = looping.proc.wait(300)
        output = "".join(looping.output)
        assert code == 1, output[-3000:]
        log = state / "logs" / "params.log"
        assert "params keeps failing" in output and str(log) in " ".join(output.split()), output[-3000:]
        assert "NotADirectoryError" in log.read_text(), "the log shows why it cannot start"
        end = looping.event("end")
        assert end is not None and not end["completed"] and "params keeps failing" in end["failure"], end
        summary = json.loads((state / "report-partial" / "summary.json").read_text())
        params = [r for r in summary["restarts"] if r["component"] == "params"]
        assert len(params) == 2, f"the kill, then a restart that died at start-up: {params}"
        assert params[0]["error"].startswith("the restart failed") and "died again while starting" in params[0]["error"]
        assert params[-1]["error"].startswith("crash loop"), params
        assert "params keeps failing" in summary["failure"]
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace], \
            "the stopped job removed its actors"
    finally:
        if looping.proc.poll() is None:
            looping.proc.kill()


@pytest.mark.timeout(600)
def test_resume_takes_over_a_job_whose_driver_died(local_cluster: LocalCluster, tmp_path: Path) -> None:
    namespace = "staleflow-ray-e2e-resumed"
    config, state = job_file(tmp_path, local_cluster.cluster, namespace, steps=30), tmp_path / "state"
    first = start_up(tmp_path, config, state)
    try:
        wait_for(lambda: first.event("component", "trainer") or first.proc.poll() is not None, 240, "the job started")
        assert first.proc.poll() is None, "".join(first.output)
        first.proc.kill()  # the driver dies; the detached actors train on
        first.proc.wait()
        pids = {name: where(name, namespace)["pid"] for name in ("manager", "inst-0")}
        second = subprocess.run([sys.executable, "-m", "staleflow.cli", "up", "--launcher", "ray", "--resume",
                                 "--config", str(config), "--state-dir", str(state), "--json-log"],
                                capture_output=True, text=True, timeout=500, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        end = [json.loads(line) for line in second.stdout.splitlines() if line.startswith("{")][-1]
        assert second.returncode == 0 and end["event"] == "end" and end["completed"], second.stdout[-3000:] + second.stderr[-3000:]
        assert end["staleness_violations"] == 0
        started = {e["name"]: e["url"] for e in (json.loads(line) for line in second.stdout.splitlines()
                                                   if line.startswith("{")) if e["event"] == "component"}
        assert set(started) >= {*SERVICES, *INSTANCES, "trainer"}, "the new driver took over every component"
        versions = [json.loads(line)["version"] for line in (state / "trainer" / "steps.jsonl").read_text().splitlines()]
        assert versions == list(range(30)), "each version trained once across the change of driver"
        placement = json.loads((state / "placement.json").read_text())  # written by the new driver
        assert {n: placement[n]["pid"] for n in pids} == pids, "it took over the running components, not new ones"
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    finally:
        if first.proc.poll() is None:
            first.proc.kill()


@pytest.mark.timeout(600)
def test_down_removes_a_job_whose_driver_died(local_cluster: LocalCluster, tmp_path: Path) -> None:
    namespace = "staleflow-ray-e2e-orphan"
    orphan = start_up(tmp_path, job_file(tmp_path, local_cluster.cluster, namespace, steps=1000), tmp_path / "state")
    try:
        wait_for(lambda: orphan.event("component", "trainer") or orphan.proc.poll() is not None, 240, "the job started")
        assert orphan.proc.poll() is None, "".join(orphan.output)
        orphan.proc.kill()  # the driver dies; the detached actors do not depend on it
        orphan.proc.wait()
        manager = registry(namespace)["manager"]["url"]
        assert get_json(manager, "/v1/health")
        down = subprocess.run([sys.executable, "-m", "staleflow.cli", "down", "--namespace", namespace,
                               "--ray-address", local_cluster.cluster.address], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        assert down.returncode == 0, down.stdout + down.stderr
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        left = [pg for pg in ray.util.placement_group_table().values()
                if (pg.get("name") or "").startswith(namespace) and pg["state"] != "REMOVED"]
        assert not left, left
        wait_for(lambda: not _answers(manager), 60, "the removed job's services stop answering")
    finally:
        if orphan.proc.poll() is None:
            orphan.proc.kill()


def _answers(url: str) -> bool:
    try:
        get_json(url, "/v1/health")
        return True
    except httpx.HTTPError:
        return False


def test_an_infeasible_plan_fails_fast_naming_what_is_missing(local_cluster: LocalCluster, tmp_path: Path) -> None:
    from staleflow.config import JobConfig
    from staleflow.launch.ray.common import LauncherError
    from staleflow.launch.ray.job import RayClusterJob

    too_big = JobConfig.model_validate(yaml.safe_load(job_file(tmp_path, local_cluster.cluster, "staleflow-too-big",
                                                               instances=8).read_text()) | {"state_dir": str(tmp_path / "a")})
    with pytest.raises(LauncherError, match="cannot hold 8 instances of CPU 0.5, GPU 1"):
        RayClusterJob(too_big).start()
    config = job_file(tmp_path, local_cluster.cluster, "staleflow-no-such-label")
    data = yaml.safe_load(config.read_text())
    data["cluster"]["trainer"] = {"labels": {"staleflow.io/role": "trainer"}}
    config.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "staleflow.cli", "up", "--launcher", "ray", "--config", str(config),
                          "--state-dir", str(tmp_path / "b")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "COLUMNS": "300"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "labels staleflow.io/role=trainer" in out.stderr, out.stderr
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"].startswith("staleflow-")]


def test_teardown_leaves_no_ray_process(local_cluster: LocalCluster) -> None:
    ran = local_cluster.stop()
    assert ran, "the cluster's processes were this process's children"
    wait_for(lambda: not still_running(ran), 30, "every process of the cluster exits")
