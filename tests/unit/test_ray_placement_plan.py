"""The Ray launcher's pre-flight check: a plan the cluster cannot host fails before anything starts,
naming the missing resource or label (pure: node records as ``ray.nodes()`` returns them)."""

from __future__ import annotations

import pytest

from staleflow.config import JobConfig
from staleflow.launch.ray_cluster import LauncherError, PlacementPlan, preflight


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
        preflight(job(instances=5), CLUSTER)


def test_a_missing_label_is_named() -> None:
    relabelled = [n if n["NodeID"] != "control" else {**n, "Labels": {"staleflow.io/role": "ctl"}} for n in CLUSTER]
    with pytest.raises(LauncherError, match=r"no alive node .* control nodes \(custom resource 'staleflow_control' "
                                            r"and labels staleflow.io/role=control\)"):
        preflight(job(), relabelled)


def test_a_dead_node_does_not_count() -> None:
    dead = [n if n["NodeID"] != "trainer" else {**n, "Alive": False} for n in CLUSTER]
    with pytest.raises(LauncherError, match="trainer nodes"):
        preflight(job(), dead)


def test_trainer_ranks_spread_over_distinct_nodes() -> None:
    config = job(engine="vllm", trainer={"world_size": 4}, cluster={"trainer_nodes": 2})
    assert PlacementPlan.of(config).ranks_per_node == 2
    with pytest.raises(LauncherError, match="the trainer needs 2 of the trainer nodes .* the cluster has 1"):
        preflight(config, CLUSTER)
    preflight(config, [*CLUSTER, {**CLUSTER[3], "NodeID": "trainer-2"}])


def test_ranks_must_split_evenly_over_the_trainer_nodes() -> None:
    with pytest.raises(LauncherError, match="do not split evenly"):
        PlacementPlan.of(job(engine="vllm", trainer={"world_size": 3}, cluster={"trainer_nodes": 2}))


def test_selecting_by_resource_alone_ignores_labels() -> None:
    unlabelled = [{**n, "Labels": {}} for n in CLUSTER]
    by_resource = {role: {"resource": f"staleflow_{role}", "labels": {}} for role in ("control", "rollout", "trainer")}
    preflight(job(cluster=by_resource), unlabelled)
