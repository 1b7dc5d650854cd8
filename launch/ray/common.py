"""What the Ray launcher's parts share, and what the CLI does with a Ray job: the job's names
(namespace, registry, trainer ranks, relays), Ray's import, and connecting to, reading and
removing a job on the cluster (``staleflow down``, ``staleflow status --namespace``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

from staleflow.config import JobConfig

REGISTRY = "endpoints"
CONTROL_SERVICES = ("manager", "params", "reward", "ts", "coordinator")
PLACEMENT_GROUPS = ("control", "rollout", "trainer")
RAY_MISSING = "the Ray launcher needs Ray: pip install 'staleflow[ray]' (Ray 2.60 or newer)"


class LauncherError(RuntimeError):
    """The Ray launcher cannot do what was asked; the message says why and what to change."""


def import_ray():
    try:
        import ray.exceptions  # binds ray too; the job catches the exceptions' classes
    except ImportError:
        raise LauncherError(RAY_MISSING) from None
    return ray


def actor_result(ray: Any, refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` of what an actor call returns. Ray's stubs read an actor handle's methods as
    ``Never``, so the call's result would match ``ray.get``'s list overload; this says Any."""
    return ray.get(refs, timeout=timeout)


def named_actors(ray: Any) -> list[dict[str, str]]:
    """Every named actor of the cluster, as ``{name, namespace}`` (Ray's stub says a list of names,
    which it returns for one namespace only)."""
    return ray.util.list_named_actors(all_namespaces=True)


def namespace_of(config: JobConfig) -> str:
    if config.cluster.namespace:
        return config.cluster.namespace
    name = re.sub(r"[^A-Za-z0-9._-]", "-", config.state_dir.resolve().name).strip("-.") or "job"
    return f"staleflow-{name}"


def start_timeout(config: JobConfig) -> float:
    """How long a component may take to come up: ``cluster.start_timeout_s``, else a minute for the
    sim engine and 15 for vLLM (an engine on a busy CPU starts slowly)."""
    return config.cluster.start_timeout_s or (60.0 if config.engine == "sim" else 900.0)


def trainer_rank_name(rank: int) -> str:
    return f"trainer-{rank}"


def trainer_world(config: JobConfig) -> int:
    return 1 if config.engine == "sim" else config.trainer.world_size


def is_relay(name: str) -> bool:
    return name.startswith("relay-")


def relay_on(endpoints: dict[str, dict], node_id: str) -> str | None:
    """The URL of the parameter-server relay on node ``node_id``, if the job has one there."""
    return next((e["url"] for n, e in sorted(endpoints.items())
                 if is_relay(n) and isinstance(e, dict) and e.get("node_id") == node_id), None)


def join_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def actor_views(ray: Any, actor: Any = None) -> dict:
    """Ray's records of every actor, by actor id (one call to the GCS actor table); with ``actor``,
    that actor's record (State, NumRestarts, Pid), empty if Ray cannot say."""
    from ray._private import state

    with contextlib.suppress(Exception):
        return state.actors(actor_id=actor._actor_id.hex()) if actor is not None else state.actors()
    return {}


def remove_job(ray: Any, namespace: str) -> dict[str, list[str]]:
    """Kill every named actor of the job's namespace and remove its placement groups."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    killed = []
    for entry in named_actors(ray):
        if entry["namespace"] != namespace:
            continue
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            killed.append(entry["name"])
    removed = []
    for group_id, entry in ray.util.placement_group_table().items():
        name = entry.get("name") or ""
        if name.startswith(f"{namespace}-") and name[len(namespace) + 1:] in PLACEMENT_GROUPS \
                and entry.get("state") != "REMOVED":
            with contextlib.suppress(Exception):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
                removed.append(name)
    return {"actors": killed, "placement_groups": removed}


def connect(address: str | None, namespace: str) -> Any:
    """Attach this process to the cluster as a driver in the job's namespace (for the CLI)."""
    ray = import_ray()
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
    except ConnectionError as exc:
        raise LauncherError(f"cannot reach the Ray cluster at {address}: {exc}; pass --ray-address or set $RAY_ADDRESS") from None
    return ray


def registry_endpoints(address: str | None, namespace: str) -> dict[str, dict]:
    """The endpoints map of the job in ``namespace``, from its registry actor."""
    ray = connect(address, namespace)
    try:
        registry = ray.get_actor(REGISTRY, namespace=namespace)
    except ValueError:
        raise LauncherError(f"no StaleFlow job in Ray namespace {namespace!r} (no {REGISTRY!r} actor there)") from None
    return ray.get(registry.get.remote(), timeout=30)
