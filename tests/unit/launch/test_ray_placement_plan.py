"""The Ray launcher's placement plan and pre-flight check: roles go to the nodes marked for them
where the cluster has marks, else to any node with room (CPU for control, GPU bundles for rollout
and trainer, none for the sim engine); a plan the cluster cannot host fails before anything starts,
naming the missing resource or label (pure: node records as ``ray.nodes()`` returns them)."""

from __future__ import annotations

import pytest

from staleflow.config import JobConfig, NodeSelector
from staleflow.launch.ray.common import LauncherError
from staleflow.launch.ray.placement import PlacementPlan, preflight


def node(node_id: str, labels: dict | None = None, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Labels": labels or {},
            "Resources": {"CPU": 8.0, **resources}}


def job(**overrides: object) -> JobConfig:
    return JobConfig.model_validate({"engine": "sim", "instances": 4, **overrides})


CLUSTER = [
    node("head"),
    node("control", {"staleflow.io/role": "control"}, staleflow_control=1),
    node("rollout", {"staleflow.io/role": "rollout"}, GPU=4, staleflow_rollout=1),
    node("trainer", {"staleflow.io/role": "trainer"}, GPU=8, staleflow_trainer=1),
]


def test_a_cluster_with_every_role_passes() -> None:
    preflight(job(), CLUSTER)


def test_too_few_gpus_for_the_instances_names_them() -> None:
    with pytest.raises(LauncherError, match=r"rollout nodes .* cannot hold 5 instances of CPU 0.5, GPU 1 \(room for 4"):
        preflight(job(engine="vllm", instances=5), CLUSTER)


def test_a_missing_label_is_named() -> None:
    relabelled = [n if n["NodeID"] != "control" else {**n, "Labels": {"staleflow.io/role": "ctl"}} for n in CLUSTER]
    with pytest.raises(LauncherError, match=r"no alive node .* control nodes \(custom resource 'staleflow_control' "
                                            r"and labels staleflow.io/role=control\)"):
        preflight(job(cluster={"control": {"resource": "staleflow_control", "labels": {"staleflow.io/role": "control"}}}),
                  relabelled)


def test_a_dead_node_does_not_count() -> None:
    dead = [n if n["NodeID"] != "trainer" else {**n, "Alive": False} for n in CLUSTER]
    # no trainer node left alive: the trainer takes two of the rollout node's GPUs, the instances lack them
    with pytest.raises(LauncherError, match=r"cannot hold 4 instances of CPU 0.5, GPU 1 \(room for 2; GPUs on them: 4\)"):
        preflight(job(engine="vllm"), dead)


def test_trainer_ranks_spread_over_distinct_nodes() -> None:
    config = job(engine="vllm", trainer={"world_size": 4}, cluster={"trainer_nodes": 2})
    assert PlacementPlan.of(config, CLUSTER).ranks_per_node == 2
    with pytest.raises(LauncherError, match="the trainer needs 2 of the trainer nodes .* the cluster has 1"):
        preflight(config, CLUSTER)
    preflight(config, [*CLUSTER, {**CLUSTER[3], "NodeID": "trainer-2"}])


def test_ranks_must_split_evenly_over_the_trainer_nodes() -> None:
    with pytest.raises(LauncherError, match="do not split evenly"):
        PlacementPlan.of(job(engine="vllm", trainer={"world_size": 3}, cluster={"trainer_nodes": 2}), CLUSTER)


def test_selecting_by_resource_alone_ignores_labels() -> None:
    unlabelled = [{**n, "Labels": {}} for n in CLUSTER]
    by_resource = {role: {"resource": f"staleflow_{role}", "labels": {}} for role in ("control", "rollout", "trainer")}
    preflight(job(cluster=by_resource), unlabelled)


# ---------------------------------------------------------------------------- a cluster as Ray starts it

PLAIN_CPU = [node("head"), node("a"), node("b")]  # no labels, no custom resources, no GPUs
PLAIN_GPU = [node("head"), node("g1", GPU=8), node("g2", GPU=8)]


def test_a_sim_job_runs_on_a_plain_cpu_cluster_asking_for_no_gpu() -> None:
    plan = preflight(job(), PLAIN_CPU)
    assert plan.selectors == {role: NodeSelector() for role in ("control", "rollout", "trainer")}
    bundles = [*plan.control, *plan.rollout, *plan.trainer]
    assert all("GPU" not in b for b in bundles), bundles
    assert all(set(b) == {"CPU"} for b in bundles), "no custom resource asked for where no node has one"
    assert len(plan.rollout) == 4 and len(plan.trainer) == 1


def test_a_real_job_places_by_gpu_bundles_split_as_it_asks() -> None:
    config = job(engine="vllm", instances=4, trainer={"world_size": 8}, cluster={"trainer_nodes": 2, "gpus_per_instance": 2})
    plan = preflight(config, PLAIN_GPU)
    assert plan.rollout == [{"CPU": 0.5, "GPU": 2}] * 4, "one bundle per instance holding its tensor parallelism"
    assert plan.trainer == [{"CPU": 2.0, "GPU": 4}] * 2 and plan.ranks_per_node == 4, "ranks split over the nodes"
    assert all(set(b) == {"CPU"} for b in plan.control), "control services on CPU"


def test_a_real_job_on_a_cluster_without_gpus_names_them() -> None:
    with pytest.raises(LauncherError, match=r"the trainer needs 1 of the trainer nodes \(any node\) with CPU 1, GPU 2 "
                                            r"each; the cluster has 0.*rollout nodes \(any node\) cannot hold 4 "
                                            r"instances of CPU 0.5, GPU 1 \(room for 0; GPUs on them: 0\)"):
        preflight(job(engine="vllm"), PLAIN_CPU)


def test_roles_sharing_nodes_take_their_room_from_what_is_left() -> None:
    one_node = [node("head"), node("g", GPU=8)]
    preflight(job(engine="vllm", instances=4, trainer={"world_size": 4}), one_node)
    with pytest.raises(LauncherError, match=r"rollout nodes .* cannot hold 5 instances of CPU 0.5, GPU 1 \(room for 4"):
        preflight(job(engine="vllm", instances=5, trainer={"world_size": 4}), one_node)
    two = [node("a"), node("b")]  # 16 CPUs: 0.6 for the control services, 0.5 for the sim rank, 14.9 for instances
    preflight(job(instances=29), two)
    with pytest.raises(LauncherError, match=r"room for 29"):
        preflight(job(instances=30), two)


def test_gpus_asked_for_explicitly_are_honoured_by_a_sim_job() -> None:
    plan = preflight(job(instances=2, cluster={"gpus_per_instance": 1, "gpus_per_rank": 1}), PLAIN_GPU)
    assert plan.rollout == [{"CPU": 0.5, "GPU": 1}] * 2 and plan.trainer == [{"CPU": 0.5, "GPU": 1}]


def test_marked_nodes_are_preferred_role_by_role() -> None:
    cluster = [node("head"), node("ctl", {"staleflow.io/role": "control"}), node("g", GPU=8, staleflow_rollout=1)]
    plan = preflight(job(engine="vllm"), cluster)
    assert plan.selectors["control"] == NodeSelector(labels={"staleflow.io/role": "control"}), "by its label"
    assert plan.selectors["rollout"] == NodeSelector(resource="staleflow_rollout"), "by its resource"
    assert plan.selectors["trainer"] == NodeSelector(), "no node marked for it: any node with room"
    assert plan.rollout[0] == {"CPU": 0.5, "GPU": 1, "staleflow_rollout": 0.001}
    dead_mark = [n if n["NodeID"] != "ctl" else {**n, "Alive": False} for n in cluster]
    assert PlacementPlan.of(job(), dead_mark).selectors["control"] == NodeSelector(), "a dead node marks nothing"


def test_a_selector_the_job_names_is_kept_even_where_no_node_matches() -> None:
    with pytest.raises(LauncherError, match=r"no alive node .* control nodes \(custom resource 'big_memory'\)"):
        preflight(job(cluster={"control": {"resource": "big_memory"}}), PLAIN_CPU)
