"""Planning a Ray job on the driver: the placement groups' bundles, the nodes each role may use,
and a preflight that fails at once, naming what is missing, when the cluster cannot host the plan."""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.config import JobConfig, NodeSelector
from staleflow.launch.ray.common import CONTROL_SERVICES, REGISTRY, LauncherError, trainer_world

RESOURCE_SHARE = 0.001  # of a role's custom resource per actor: the resource marks nodes, it does not count
ROLES = ("control", "rollout", "trainer")
PLACEMENT_ORDER = ("control", "trainer", "rollout")
"""The order the placement groups are placed in (and checked): the trainer's bundles, one per
node, are the hardest to fit, so they go before the instances fill the GPUs one by one."""


def role_marker(role: str) -> NodeSelector:
    """What marks a node for a role when the job names no nodes for it: the custom resource
    ``staleflow_<role>``, the label ``staleflow.io/role=<role>``."""
    return NodeSelector(resource=f"staleflow_{role}", labels={"staleflow.io/role": role})


def select_nodes(config: JobConfig, role: str, nodes: list[dict]) -> NodeSelector:
    """The nodes a role may use. A selector in the job's ``cluster:`` section is kept as it is (no
    node matching it fails the start). Without one: the nodes marked for the role (its resource,
    else its label) where any alive node carries the mark, else any node with room, as every
    Ray cluster starts."""
    chosen = getattr(config.cluster, role)
    if chosen is not None:
        return chosen
    mark = role_marker(role)
    alive = [n for n in nodes if n.get("Alive")]
    if any(n["Resources"].get(mark.resource, 0) > 0 for n in alive):
        return NodeSelector(resource=mark.resource)
    if any(_matches(n, NodeSelector(labels=mark.labels)) for n in alive):
        return NodeSelector(labels=mark.labels)
    return NodeSelector()


def gpus_per_instance(config: JobConfig) -> float:
    """A simulated instance needs no GPU; a real one its tensor parallelism (1 unless set)."""
    chosen = config.cluster.gpus_per_instance
    return chosen if chosen is not None else (0.0 if config.engine == "sim" else 1.0)


def gpus_per_rank(config: JobConfig) -> float:
    """The sim trainer needs no GPU; an FSDP rank one unless set (0: CPU ranks with gloo)."""
    chosen = config.cluster.gpus_per_rank
    return chosen if chosen is not None else (0.0 if config.engine == "sim" else 1.0)


def selector_text(role: str, selector: NodeSelector) -> str:
    parts = []
    if selector.resource:
        parts.append(f"custom resource {selector.resource!r}")
    if selector.labels:
        parts.append("labels " + ", ".join(f"{k}={v}" for k, v in selector.labels.items()))
    return f"{role} nodes ({' and '.join(parts) or 'any node'})"


def _bundle(selector: NodeSelector, cpus: float, gpus: float = 0.0) -> dict[str, float]:
    bundle: dict[str, float] = {}
    if cpus:
        bundle["CPU"] = cpus
    if gpus:
        bundle["GPU"] = gpus
    if selector.resource:
        bundle[selector.resource] = RESOURCE_SHARE
    return bundle or {"CPU": 0.001}  # a bundle must hold something


@dataclass
class PlacementPlan:
    """What each placement group asks for, and the nodes that may host it: control services on
    CPU, one bundle per instance holding its GPUs, one bundle per trainer node holding its
    ranks' GPUs (the GPU count of each split as the job asks)."""

    control: list[dict[str, float]]
    rollout: list[dict[str, float]]
    trainer: list[dict[str, float]]  # one bundle per trainer node
    ranks_per_node: int
    selectors: dict[str, NodeSelector]

    @staticmethod
    def of(config: JobConfig, nodes: list[dict]) -> PlacementPlan:
        c = config.cluster
        world = trainer_world(config)
        if world % c.trainer_nodes:
            raise LauncherError(f"{world} trainer ranks do not split evenly over cluster.trainer_nodes "
                                f"{c.trainer_nodes}; make trainer.world_size a multiple of it")
        per_node = world // c.trainer_nodes
        selectors = {role: select_nodes(config, role, nodes) for role in ROLES}
        return PlacementPlan(
            control=[_bundle(selectors["control"], c.cpus_per_service) for _ in (*CONTROL_SERVICES, REGISTRY)],
            rollout=[_bundle(selectors["rollout"], c.cpus_per_instance, gpus_per_instance(config))
                     for _ in range(config.instances)],
            trainer=[_bundle(selectors["trainer"], c.cpus_per_rank * per_node, gpus_per_rank(config) * per_node)
                     for _ in range(c.trainer_nodes)],
            ranks_per_node=per_node, selectors=selectors)


def _matches(node: dict, selector: NodeSelector) -> bool:
    if selector.resource and node["Resources"].get(selector.resource, 0) <= 0:
        return False
    labels = node.get("Labels") or {}
    return all(labels.get(k) == v for k, v in selector.labels.items())


def _fits(bundle: dict[str, float], capacity: dict[str, float]) -> bool:
    return all(capacity.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def need_text(bundle: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in bundle.items() if v != RESOURCE_SHARE)


def _take(capacity: dict[str, float], bundle: dict[str, float]) -> None:
    for k, v in bundle.items():
        capacity[k] = capacity.get(k, 0.0) - v


def preflight(config: JobConfig, nodes: list[dict]) -> PlacementPlan:
    """Fail now, naming what is missing, when the cluster cannot host the plan (a placement group
    it cannot satisfy would otherwise wait in PENDING without a word). Roles may share nodes:
    each takes its room from what the roles placed before it left."""
    plan = PlacementPlan.of(config, nodes)
    alive = [n for n in nodes if n.get("Alive")]
    capacity = {n["NodeID"]: dict(n["Resources"]) for n in alive}
    problems = []
    for role in PLACEMENT_ORDER:
        bundles, selector = getattr(plan, role), plan.selectors[role]
        candidates = [n["NodeID"] for n in alive if _matches(n, selector)]
        what = selector_text(role, selector)
        if not candidates:
            problems.append(f"no alive node of the Ray cluster is one of the {what}")
            continue
        if role == "control":  # all on one node
            total: dict[str, float] = {k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}
            host = next((node for node in candidates if _fits(total, capacity[node])), None)
            if host is None:
                problems.append(f"no single one of the {what} has room for the control services "
                                f"({need_text(total)})")
            else:
                _take(capacity[host], total)
        elif role == "trainer":  # one bundle per node, on distinct nodes
            hosts = [node for node in candidates if _fits(bundles[0], capacity[node])]
            if len(hosts) < len(bundles):
                problems.append(f"the trainer needs {len(bundles)} of the {what} with {need_text(bundles[0])} each; "
                                f"the cluster has {len(hosts)}")
            for node in hosts[:len(bundles)]:
                _take(capacity[node], bundles[0])
        else:
            for i, bundle in enumerate(bundles):
                host = next((node for node in candidates if _fits(bundle, capacity[node])), None)
                if host is None:
                    gpus = sum(n["Resources"].get("GPU", 0) for n in alive if n["NodeID"] in candidates)
                    problems.append(f"the {what} cannot hold {len(bundles)} instances of {need_text(bundle)} "
                                    f"(room for {i}; GPUs on them: {gpus:g})")
                    break
                _take(capacity[host], bundle)
    if problems:
        raise LauncherError("the Ray cluster cannot host this job: " + "; ".join(problems))
    return plan
