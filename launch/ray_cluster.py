"""`staleflow up --launcher ray`: the job's components as detached, named Ray actors.

Ray places and restarts the processes; StaleFlow's own HTTP contracts stay the data and control
plane. Each component (manager, parameter server, reward, trajectory server, rollout instances,
coordinator) is one actor running what ``staleflow serve component NAME`` runs: ``build_app`` +
an HTTP server on the node that hosts it. Trainer ranks are one actor each.

* **Placement.** Detached placement groups in a per-job namespace: ``control`` (every control
  service on CPU, one node), ``trainer`` (one bundle per trainer node, ranks split evenly, bundles
  sorted by node IP) and ``rollout`` (one bundle per instance, holding its GPUs; none for the sim
  engine). On a cluster as Ray starts it, roles go wherever there is room; nodes marked for a role
  (its custom resource or label) or a selector in the job's ``cluster:`` section narrow that.
  A plan the cluster cannot satisfy fails before anything starts, naming what is missing.
* **Endpoints** are planned on the node that serves them: a probe task in the component's bundle
  returns the node's IP and a free port from ``cluster.port_range``. The map is published in
  ``<state>/endpoints.json`` and in the ``endpoints`` registry actor, so any machine attached to the
  cluster finds the job by its namespace.
* **Faults.** A component that dies while the job starts is restarted like one that dies later
  (one whose start fails exits, so that Ray restarts it) and the start-up waits for it.
  Service and instance actors restart in place (``max_restarts``), re-binding their
  planned port; one that comes back on another node takes a new port there, updates the registry
  and, for an instance, re-registers with the coordinator (``PUT /v1/instances/{id}``). An instance
  whose engine died exits so Ray restarts it. Trainer ranks restart as a gang (NCCL cannot repair
  a communicator), resuming from the newest checkpoint and the step log.
* **Supervision.** The job's supervisor (``staleflow.launch.supervisor``, the same one a local
  run has) drives this launcher through ``staleflow.launch.launcher.Launcher``: it sees an actor's
  process die in Ray's actor table, waits for Ray's restart and records it (``summary.json``'s
  ``restarts``), kills for Ray to restart a service whose health probe keeps failing or an
  instance the coordinator declares failed, restarts the trainer gang, and stops the job when a
  component keeps failing (``supervision.max_restarts`` within ``restart_window_s``).
* **Token.** The run's bearer token is a constructor argument each actor puts into its own
  environment, never a ``runtime_env`` variable (Ray's dashboard shows those).

Ray is imported lazily: nothing here runs unless ``--launcher ray`` is asked for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from staleflow.config import JobConfig, NodeSelector
from staleflow.launch.launcher import BeyondRepair, Supervised
from staleflow.launch.state_lock import StateDirLock

log = logging.getLogger(__name__)

REGISTRY = "endpoints"
CONTROL_SERVICES = ("manager", "params", "reward", "ts", "coordinator")
PLACEMENT_GROUPS = ("control", "rollout", "trainer")
START_ATTEMPTS = 5  # restarts of a component that never comes up before the start-up gives up on it
TRAINER = "trainer"  # the trainer gang, one component to the supervisor
RESOURCE_SHARE = 0.001  # of a role's custom resource per actor: the resource marks nodes, it does not count
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


def trainer_rank_name(rank: int) -> str:
    return f"trainer-{rank}"


def trainer_world(config: JobConfig) -> int:
    return 1 if config.engine == "sim" else config.trainer.world_size


# ---------------------------------------------------------------------------- on the nodes


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def free_port(host: str, low: int, high: int, taken: set[int] | frozenset = frozenset()) -> int:
    """A port free on ``host`` now, from [low, high], not in ``taken``; tried from a random start
    so that launchers on one node rarely race for the same port."""
    from staleflow.servers.http import free_port_between

    port = free_port_between(host, low, high, taken)
    if port is None:
        raise LauncherError(f"no free port on {host} in {low}-{high}; widen cluster.port_range")
    return port


def probe(low: int, high: int, taken: list[int]) -> dict:
    """Run inside a component's placement: where it will serve."""
    import ray

    host = node_ip()
    return {"host": host, "port": free_port(host, low, high, set(taken)),
            "node_id": ray.get_runtime_context().get_node_id()}


def is_relay(name: str) -> bool:
    return name.startswith("relay-")


def relay_on(endpoints: dict[str, dict], node_id: str) -> str | None:
    """The URL of the parameter-server relay on node ``node_id``, if the job has one there."""
    return next((e["url"] for n, e in sorted(endpoints.items())
                 if is_relay(n) and isinstance(e, dict) and e.get("node_id") == node_id), None)


def relay_app(config: JobConfig, namespace: str, name: str, token: str, upstream: str):
    """A relay's parameter server, its versions in node-local storage (shared memory serves them),
    in a directory of this run's own (named after its token's hash): a later job in the same
    namespace must never find this one's versions there. With ``params.sources: ros`` the relay is
    a holder of the job's parameter server (``upstream``): it pulls each version from its holders
    and serves what it holds to the other nodes' relays, on its node's address."""
    import hashlib
    import tempfile

    from staleflow.servers.params import ParamsConfig, create_app

    run = hashlib.sha256(token.encode()).hexdigest()[:12]
    where = Path(tempfile.gettempdir()) / f"staleflow-relay-{namespace}-{name}-{run}"
    holder = ({"holder_of": upstream, "holder_id": f"{namespace}-{name}", "host": node_ip(),
               "holder_ttl_s": config.params.holder_ttl_s} if config.params.sources == "ros" else {})
    return create_app(ParamsConfig(state_dir=where, keep=3, fsync=False, **holder))


def _join(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _log_to_state(config: JobConfig, name: str) -> None:
    """Each actor also logs to ``<state>/logs/NAME.log`` where the state directory is reachable
    (the control node's volume, a shared file system); Ray's own worker logs have it anyway. What
    is written to ``sys.stderr`` from now on goes there too: the HTTP server logs the cause of a
    failed start-up there, as a component's own process does on a local run."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(OSError):
        (config.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(config.state_dir / "logs" / f"{name}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        # a file of its own: configuring logging (uvicorn does) closes every handler's stream
        sys.stderr = _Tee(sys.stderr, (config.state_dir / "logs" / f"{name}.log").open("a", buffering=1))


class _Tee:
    """A text stream that writes to ``first`` and to ``second`` (whose failures are ignored)."""

    def __init__(self, first: Any, second: Any):
        self.first, self.second = first, second

    def write(self, text: str) -> int:
        with contextlib.suppress(Exception):
            self.second.write(text)
            self.second.flush()
        return self.first.write(text)

    def flush(self) -> None:
        self.first.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.first, name)


class Registry:
    """The job's endpoints map, for any machine attached to the cluster; kept in a file on its
    node too, so a restarted registry starts from the newest map, not from the first one."""

    def __init__(self, endpoints: dict[str, dict], path: str):
        self.path = Path(path)
        self.endpoints = dict(endpoints)
        with contextlib.suppress(OSError, ValueError):
            self.endpoints.update(json.loads(self.path.read_text()))

    def get(self) -> dict[str, dict]:
        return self.endpoints

    def put(self, name: str, entry: dict) -> dict[str, dict]:
        self.endpoints[name] = entry
        with contextlib.suppress(OSError):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.endpoints, indent=2))
            os.replace(tmp, self.path)
        return self.endpoints


class Component:
    """One component of the job, serving on the node Ray placed it on."""

    def __init__(self, name: str, config_json: str, token: str, namespace: str):
        try:
            self._start(name, config_json, token, namespace)
        except Exception:  # Ray never restarts an actor whose constructor raised: exit instead
            log.exception("%s failed to start; exiting so Ray restarts it", name)
            logging.shutdown()
            os._exit(1)

    def _start(self, name: str, config_json: str, token: str, namespace: str) -> None:
        """Build the component and serve it. A peer restarting meanwhile may make this fail: the
        process then exits and Ray starts it again, as for a component that dies later."""
        import ray

        from staleflow.launch.job import build_app
        from staleflow.servers.auth import TOKEN_ENV
        from staleflow.servers.http import serve_in_thread

        os.environ[TOKEN_ENV] = token  # for this process's clients; never in the actor's runtime_env
        self.name = name
        config = JobConfig.model_validate_json(config_json)
        _log_to_state(config, name)
        registry = ray.get_actor(REGISTRY, namespace=namespace)
        endpoints = actor_result(ray, registry.get.remote())
        planned, here = endpoints[name], node_ip()
        node_id = ray.get_runtime_context().get_node_id()
        moved = planned.get("node_id", node_id) != node_id or planned["host"] != here
        self.namespace = namespace
        self.params_url = relay_on(endpoints, node_id) if name.startswith("inst-") else None
        make_app = (lambda: relay_app(config, namespace, name, token, endpoints["params"]["url"])) if is_relay(name) else \
            (lambda: build_app(name, config, endpoints))
        app = make_app()
        timeout = config.cluster.start_timeout_s or (60.0 if config.engine == "sim" else 900.0)
        self.server = None
        if not moved:
            try:
                self.server = serve_in_thread(app, here, planned["port"], token=token, startup_timeout=timeout)
            except OSError:  # someone took the port since: serve on another one, like a moved component
                moved = True
                app = make_app()
        if moved:
            port = free_port(here, *config.cluster.port_range)
            endpoints[name] = {"url": _join(here, port), "host": here, "port": port, "node_id": node_id}
            if self.params_url:
                endpoints[name]["params_url"] = self.params_url
            self.server = serve_in_thread(app, here, port, token=token, startup_timeout=timeout)
            ray.get(registry.put.remote(name, endpoints[name]))
            log.warning("%s moved to %s", name, endpoints[name]["url"])
        self.url = endpoints[name]["url"]
        if name.startswith("inst-"):  # every start: a no-op in place, the new address after a move
            threading.Thread(target=self._reregister, args=(endpoints,), daemon=True).start()
        if is_relay(name) and config.params.sources != "ros":  # a holder pulls new versions itself
            from staleflow.servers.params.relay import Mirror

            self.stop_mirror = threading.Event()
            self.mirror = Mirror(endpoints["params"]["url"], self.url, self.stop_mirror)
            threading.Thread(target=self.mirror.run, daemon=True, name="mirror").start()
        self.app = app
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def _reregister(self, endpoints: dict[str, dict]) -> None:
        """Tell the coordinator where this instance serves now (retried until it answers)."""
        from staleflow.api.base import ServiceError
        from staleflow.api.coordinator import CoordinatorClient

        body = {"instance_id": self.name, "url": self.url, "params_url": self.params_url}
        delay = 0.2
        while True:
            try:
                with CoordinatorClient(endpoints["coordinator"]["url"], timeout=10) as c:
                    c.upsert(self.name, body)
                return
            except ServiceError as exc:
                log.error("the coordinator refused %s's registration: %s", self.name, exc)
            except Exception as exc:  # the coordinator not up yet, restarting, or moving too
                log.info("registering %s with the coordinator failed: %s", self.name, exc)
            time.sleep(delay)  # retry pacing
            delay = min(delay * 2, 5.0)

    def _watch(self) -> None:
        """Exit the process when the server stopped or the engine died: Ray then restarts it."""
        while True:
            time.sleep(0.5)  # watchdog pacing
            instance = getattr(self.app.state, "instance", None)
            engine_dead = bool(getattr(getattr(instance, "engine", None), "dead", False))
            if engine_dead or self.server is None or not self.server.thread.is_alive():
                log.error("%s: %s; exiting so Ray restarts it", self.name,
                          "its engine died" if engine_dead else "its server stopped")
                os._exit(1)

    def info(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {"name": self.name, "url": self.url, "pid": os.getpid(), "node_id": context.get_node_id(),
                "host": node_ip(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


class TrainerRank:
    """One trainer rank. Rank 0 runs the trainer role; the others follow it (FSDP2). The loop
    runs in a thread so that ``state`` answers while it trains."""

    def __init__(self, rank: int, world: int, master: tuple[str, int], config_json: str, token: str,
                 namespace: str, started: float | None):
        import ray

        from staleflow.servers.auth import TOKEN_ENV

        os.environ[TOKEN_ENV] = token
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(rank),
                           "WORLD_SIZE": str(world)})
        self.rank, self.world = rank, world
        self.config = JobConfig.model_validate_json(config_json)
        if self.config.cluster.network_interface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", self.config.cluster.network_interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", self.config.cluster.network_interface)
        _log_to_state(self.config, trainer_rank_name(rank))
        self.endpoints = actor_result(ray, ray.get_actor(REGISTRY, namespace=namespace).get.remote())
        self.stop_event = threading.Event()
        self.done = False
        self.error: str | None = None
        self.started = started
        self.thread = threading.Thread(target=self._run, daemon=True, name=trainer_rank_name(rank))
        self.thread.start()

    def _run(self) -> None:
        urls = {k: v["url"] for k, v in self.endpoints.items() if isinstance(v, dict) and "url" in v}
        try:
            if self.config.engine == "sim":
                from staleflow.launch.job import run_trainer

                run_trainer(self.config, self.endpoints, self.stop_event, self.started)
            else:
                from staleflow.launch.job import model_dir
                from staleflow.training.role import run_fsdp_rank

                role = self.config.trainer_role_config(model_dir(self.config))
                run_fsdp_rank(role, urls, self.stop_event, self.started)
            self.done = True
        except BaseException as exc:  # reported through state(); the launcher restarts the gang
            log.exception("trainer rank %d failed", self.rank)
            self.error = repr(exc)

    def state(self) -> dict:
        import ray

        return {"rank": self.rank, "done": self.done, "error": self.error, "pid": os.getpid(),
                "alive": self.thread.is_alive(), "node_id": ray.get_runtime_context().get_node_id(),
                "host": node_ip(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def steps(self) -> list:
        from staleflow.launch.job import step_log

        return step_log(self.config).read()

    def stop(self) -> None:
        self.stop_event.set()


# ---------------------------------------------------------------------------- planning on the driver


ROLES = ("control", "rollout", "trainer")


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


def _selector_text(role: str, selector: NodeSelector) -> str:
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


def _need_text(bundle: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in bundle.items() if v != RESOURCE_SHARE)


PLACEMENT_ORDER = ("control", "trainer", "rollout")
"""The order the placement groups are placed in (and checked): the trainer's bundles, one per
node, are the hardest to fit, so they go before the instances fill the GPUs one by one."""


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
        what = _selector_text(role, selector)
        if not candidates:
            problems.append(f"no alive node of the Ray cluster is one of the {what}")
            continue
        if role == "control":  # all on one node
            total: dict[str, float] = {k: sum(b.get(k, 0.0) for b in bundles) for k in {k for b in bundles for k in b}}
            host = next((node for node in candidates if _fits(total, capacity[node])), None)
            if host is None:
                problems.append(f"no single one of the {what} has room for the control services "
                                f"({_need_text(total)})")
            else:
                _take(capacity[host], total)
        elif role == "trainer":  # one bundle per node, on distinct nodes
            hosts = [node for node in candidates if _fits(bundles[0], capacity[node])]
            if len(hosts) < len(bundles):
                problems.append(f"the trainer needs {len(bundles)} of the {what} with {_need_text(bundles[0])} each; "
                                f"the cluster has {len(hosts)}")
            for node in hosts[:len(bundles)]:
                _take(capacity[node], bundles[0])
        else:
            for i, bundle in enumerate(bundles):
                host = next((node for node in candidates if _fits(bundle, capacity[node])), None)
                if host is None:
                    gpus = sum(n["Resources"].get("GPU", 0) for n in alive if n["NodeID"] in candidates)
                    problems.append(f"the {what} cannot hold {len(bundles)} instances of {_need_text(bundle)} "
                                    f"(room for {i}; GPUs on them: {gpus:g})")
                    break
                _take(capacity[host], bundle)
    if problems:
        raise LauncherError("the Ray cluster cannot host this job: " + "; ".join(problems))
    return plan


# ---------------------------------------------------------------------------- the job


class RayClusterJob(Supervised):
    """A job whose components are Ray actors; the surface of ``Job`` that ``staleflow up`` uses,
    and a ``staleflow.launch.launcher.Launcher`` for the job's supervisor."""

    state_lock: StateDirLock  # taken by Job._prepare_state_dir

    check_interval_s = 0.5  # one look at Ray's actor table per round
    keeps_standby = False  # Ray starts each actor's process itself: no warm standby takes a role
    parallel_restarts = True  # Ray restarts them side by side; the supervisor waits for each

    def __init__(self, config: JobConfig, resume: bool = False, fresh: bool = False,
                 address: str | None = None, namespace: str | None = None):
        from staleflow.launch.job import Job, Monitor, step_log

        self.ray = import_ray()
        self.resume = resume
        self.config = config
        self.state = config.state_dir
        self.namespace = namespace or namespace_of(config)
        self.address = address or config.cluster.address or os.environ.get("RAY_ADDRESS") or "auto"
        Job._prepare_state_dir(self, resume, fresh)  # the same lock and state-directory rules as a local run
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.endpoints: dict[str, dict] = {}
        self.monitor = Monitor(self.endpoints, self.started)
        self.step_log = step_log(config)
        self.actors: dict[str, Any] = {}
        self.ranks: list[Any] = []
        self.pgs: dict[str, Any] = {}
        self.trainer_bundles: list[int] = []
        self._trainer_error: str | None = None
        self._trainer_failure: tuple[str, str] | None = None  # (kind, cause) of a failed gang, for the supervisor
        self._trainer_generation = 0  # bumped whenever the gang is replaced
        self._gang_lock = threading.Lock()  # the gang, its generation and its failure change together
        self._trainer_restarts = 0  # gang restarts so far (cluster.trainer_restarts bounds them)
        self._trainer_done = False
        self._steps: list = []
        self._watcher: threading.Thread | None = None
        self._owner = False
        self._incarnations: dict[str, tuple] = {}  # (NumRestarts, Pid) each actor was last seen alive as

    # -- connecting ------------------------------------------------------------------------

    def connect(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=False)
            except ConnectionError as exc:
                raise LauncherError(f"cannot reach the Ray cluster at {self.address}: {exc}; start one "
                                    "(`ray start --head`) or set cluster.address / $RAY_ADDRESS") from None

    def _options(self, **extra: Any) -> dict:
        env = dict(self.config.cluster.env)
        options = {"namespace": self.namespace, "lifetime": "detached", **extra}
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, on_started: Callable[[str, str], None] | None = None) -> None:
        from staleflow.servers.auth import write_token_file

        ray = self.ray
        self.connect()
        if REGISTRY in {a["name"] for a in named_actors(ray)
                        if a["namespace"] == self.namespace}:
            if not self.resume:
                raise LauncherError(f"a job is already running in Ray namespace {self.namespace!r}: take it over with "
                                    f"--resume, stop it with `staleflow down --namespace {self.namespace}`, or choose "
                                    "another cluster.namespace")
            self._attach(on_started)
            return
        self.plan = preflight(self.config, ray.nodes())
        self._owner = True  # from here on, what is in the namespace is this job's
        self.token = write_token_file(self.state / "token")
        self._place()
        self.endpoints.update(self._plan_endpoints())
        self.monitor.endpoints = self.endpoints
        config_json = self.config.model_dump_json()
        registry_path = str((self.state / "endpoints.registry.json").resolve())
        Registry_ = ray.remote(Registry)
        self.registry = Registry_.options(name=REGISTRY, max_restarts=-1, max_task_retries=-1,
                                          num_cpus=self._control_cpus(), resources=self._marker("control"),
                                          scheduling_strategy=self._in("control", len(CONTROL_SERVICES)),
                                          **self._options()).remote(self.endpoints, registry_path)
        ray.get(self.registry.get.remote())
        timeout = self.config.cluster.start_timeout_s or (60.0 if self.config.engine == "sim" else 900.0)
        names = self._names()
        pending: list[str] = []
        for name in names:
            if name == "coordinator":  # instances start side by side (a vLLM engine takes a while)
                self._await(pending, timeout, on_started)
                pending = []
            self.actors[name] = self._create(name, config_json)
            pending.append(name)
            if name == "ts":
                self._await(pending, timeout, on_started)
                pending = []
                self._release_previous_instances()
        self._await(pending, timeout, on_started)
        self._publish()
        self.started = self.monitor.started = time.monotonic()
        self._start_trainer()
        self._running(on_started)

    def _attach(self, on_started: Callable[[str, str], None] | None) -> None:
        """Take over a job whose actors outlived their driver (``--resume`` while they run): the
        same actors, placement groups and token; the trainer gang restarted if any rank is gone."""
        from ray.util.placement_group import get_placement_group

        from staleflow.servers.auth import read_token_file

        ray = self.ray
        token = read_token_file(self.state / "token")
        if token is None:
            raise LauncherError(f"a job runs in Ray namespace {self.namespace!r} but {self.state / 'token'} is missing: "
                                "resume it from the state directory it was started with")
        self.token, self._owner = token, True
        self.plan = PlacementPlan.of(self.config, ray.nodes())
        self.pgs = {group: get_placement_group(f"{self.namespace}-{group}") for group in PLACEMENT_GROUPS}
        self._order_bundles()
        self.registry = ray.get_actor(REGISTRY, namespace=self.namespace)
        self.endpoints.update(ray.get(self.registry.get.remote(), timeout=60))
        self.monitor.endpoints = self.endpoints
        for name in self._names():
            self.actors[name] = ray.get_actor(name, namespace=self.namespace)
        timeout = self.config.cluster.start_timeout_s or (60.0 if self.config.engine == "sim" else 900.0)
        self._await(list(self.actors), timeout, on_started)
        self._publish()
        self.started = self.monitor.started = time.monotonic()
        try:
            self.ranks = [ray.get_actor(trainer_rank_name(r), namespace=self.namespace)
                          for r in range(trainer_world(self.config))]
            states = ray.get([r.state.remote() for r in self.ranks], timeout=60)
            if any(s["error"] for s in states):
                raise RuntimeError("a trainer rank failed")
        except (ValueError, RuntimeError, ray.exceptions.RayError):
            for rank in range(trainer_world(self.config)):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(trainer_rank_name(rank), namespace=self.namespace), no_restart=True)
            self._start_trainer()
        self._running(on_started)

    def _running(self, on_started: Callable[[str, str], None] | None) -> None:
        """The trainer runs (started or attached to): record where everything is and watch it."""
        from staleflow.launch.job import trainer_label

        self._write_placement()
        if on_started:
            on_started("trainer", trainer_label(self.config))
        self._watcher = threading.Thread(target=self._watch, name="ray-launcher", daemon=True)
        self._watcher.start()
        self.supervise()

    def _marker(self, role: str) -> dict[str, float]:
        """The share of the role's custom resource each of its actors asks for (none where the
        role's nodes are not selected by a resource)."""
        selector = self.plan.selectors[role]
        return {selector.resource: RESOURCE_SHARE} if selector.resource else {}

    def _control_cpus(self) -> float:
        return self.config.cluster.cpus_per_service or (0.001 if not self.plan.selectors["control"].resource else 0)

    def _in(self, group: str, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pgs[group], placement_group_bundle_index=index)

    def _place(self) -> None:
        """The detached placement groups, ready within ``placement_timeout_s`` or a clear error."""
        ray, c = self.ray, self.config.cluster
        from ray.util.placement_group import placement_group

        plan = self.plan
        asks = {"control": (plan.control, "STRICT_PACK"), "rollout": (plan.rollout, "PACK"),
                "trainer": (plan.trainer, "STRICT_SPREAD" if len(plan.trainer) > 1 else "PACK")}
        deadline = time.monotonic() + c.placement_timeout_s
        for group in PLACEMENT_ORDER:  # each placed before the next asks: they may share nodes
            (bundles, strategy), selector = asks[group], plan.selectors[group]
            options: dict[str, Any] = {"bundle_label_selector": [dict(selector.labels) for _ in bundles]} \
                if selector.labels else {}
            if group == "control" and selector == NodeSelector():  # the driver's node has --state-dir: there if it has room
                options["_soft_target_node_id"] = ray.get_runtime_context().get_node_id()
            self.pgs[group] = placement_group(bundles, strategy=strategy, name=f"{self.namespace}-{group}",
                                              lifetime="detached", **options)
            ready, _ = ray.wait([self.pgs[group].ready()], timeout=max(0.1, deadline - time.monotonic()))
            if not ready:
                self._remove_groups()
                raise LauncherError(
                    f"placement group {group} ({len(bundles)} × {_need_text(bundles[0])}, {strategy}) was not placed in "
                    f"{c.placement_timeout_s:g} s on the {_selector_text(group, selector)}: the cluster lacks free room "
                    "for it (other jobs may hold it); see `ray status`")
        self._order_bundles()

    def _order_bundles(self) -> None:
        """Instances and trainer ranks in (node IP, node) order of their bundles; one relay bundle per rollout node."""
        ray, c = self.ray, self.config.cluster
        table = ray.util.placement_group_table(self.pgs["trainer"])
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        nodes = table["bundles_to_node_id"]
        self.trainer_bundles = sorted(nodes, key=lambda i: (ips.get(nodes[i], ""), nodes[i], i))
        rollout = ray.util.placement_group_table(self.pgs["rollout"])["bundles_to_node_id"]
        self.rollout_bundles = sorted(rollout, key=lambda i: (ips.get(rollout[i], ""), rollout[i], i))
        self.relay_bundles: list[int] = []
        if c.ps_relay == "per_rollout_node":  # the first bundle of each rollout node hosts its relay
            seen: set[str] = set()
            for i in self.rollout_bundles:
                if rollout[i] not in seen:
                    seen.add(rollout[i])
                    self.relay_bundles.append(i)

    def _scheduling(self, name: str) -> Any:
        if name.startswith("inst-"):
            return self._in("rollout", self.rollout_bundles[int(name.split("-")[1])])
        if is_relay(name):  # beside the first instance of its node, in that instance's bundle
            return self._in("rollout", self.relay_bundles[int(name.split("-")[1])])
        return self._in("control", CONTROL_SERVICES.index(name))

    def _resources(self, name: str) -> dict:
        c = self.config.cluster
        if is_relay(name):
            return {"num_cpus": 0, "resources": {}}
        if name.startswith("inst-"):
            return {"num_cpus": c.cpus_per_instance, "num_gpus": gpus_per_instance(self.config),
                    "resources": self._marker("rollout")}
        return {"num_cpus": self._control_cpus(), "resources": self._marker("control")}

    def _plan_endpoints(self) -> dict[str, dict]:
        """Each component's address, found on the node that will serve it."""

        ray = self.ray
        low, high = self.config.cluster.port_range
        probe_task = ray.remote(probe)
        planned: dict[str, dict] = {}
        taken: dict[str, list[int]] = {}
        for name in self._names():
            res = self._resources(name)
            where = ray.get(probe_task.options(num_cpus=0, resources=res["resources"],
                                               scheduling_strategy=self._scheduling(name)).remote(
                low, high, taken.get("any", [])), timeout=120)
            taken.setdefault("any", []).append(where["port"])  # one list: test clusters share one IP
            planned[name] = {"url": _join(where["host"], where["port"]), "host": where["host"], "port": where["port"],
                             "node_id": where["node_id"]}
            if name.startswith("inst-") and (relay := relay_on(planned, where["node_id"])):
                planned[name]["params_url"] = relay
        return planned

    def _names(self) -> list[str]:
        """Start order: the control services, the relays, the instances, the coordinator."""
        from staleflow.launch.job import component_names

        names = component_names(self.config)
        relays = [f"relay-{k}" for k in range(len(self.relay_bundles))]
        at = names.index("ts") + 1
        return [*names[:at], *relays, *names[at:]]

    def _create(self, name: str, config_json: str) -> Any:
        ray = self.ray
        Actor = ray.remote(Component)
        return Actor.options(name=name, max_restarts=self.config.cluster.max_restarts, max_task_retries=0,
                             max_concurrency=4, scheduling_strategy=self._scheduling(name),
                             **self._resources(name), **self._options()).remote(
            name, config_json, self.token, self.namespace)

    def _await(self, names: list[str], timeout: float, on_started: Callable[[str, str], None] | None) -> None:
        """Each component up (answering its actor), waiting out the restarts of one that died
        while starting; ``timeout`` bounds each."""
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                info = self._ask(self.actors[name], "info", deadline)
            except self.ray.exceptions.GetTimeoutError:
                raise LauncherError(f"component {name} did not come up in {timeout:g} s; see "
                                    f"{self.state / 'logs' / (name + '.log')} or its Ray worker log") from None
            except self.ray.exceptions.RayActorError as exc:
                raise LauncherError(f"component {name} failed to start: {exc}; see "
                                    f"{self.state / 'logs' / (name + '.log')} or its Ray worker log") from None
            if on_started:
                on_started(name, info["url"])

    def _ask(self, actor: Any, method: str, deadline: float, attempts: int = START_ATTEMPTS,
             since: int | None = None) -> Any:
        """``actor.method()``, called again while Ray restarts the actor (a restartable actor's
        call fails while it is down), until ``deadline`` (``time.monotonic()``). Raises Ray's
        GetTimeoutError after the deadline, RayActorError once the actor is dead for good or has
        failed ``attempts`` starts in a row here (a start that can never succeed), counted from
        its restart number ``since`` (default: the one at the first failed call)."""
        ray = self.ray
        first_restarts = since
        while True:
            try:
                return ray.get(getattr(actor, method).remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                view = actor_views(ray, actor)
                restarts = view.get("NumRestarts", 0)
                first_restarts = restarts if first_restarts is None else first_restarts
                if time.monotonic() >= deadline or view.get("State") == "DEAD" or \
                        restarts - first_restarts >= attempts:
                    raise
                log.info("%s is restarting; asking again", actor)
            time.sleep(0.2)  # retry pacing while Ray restarts the actor

    def _release_previous_instances(self) -> None:
        from staleflow.api.base import ServiceError
        from staleflow.api.trajectories import TrajectoryClient
        from staleflow.launch.job import instance_ids

        timeout = self.config.cluster.start_timeout_s or (60.0 if self.config.engine == "sim" else 900.0)
        deadline = time.monotonic() + timeout
        with TrajectoryClient(self.endpoints["ts"]["url"], token=self.token) as ts:
            for instance_id in instance_ids(self.config):
                while True:  # the trajectory server may be restarting (Ray brings it back at the same URL)
                    try:
                        ts.release(instance_id)
                        break
                    except ServiceError as exc:
                        if exc.status < 500 or time.monotonic() >= deadline:
                            raise LauncherError(f"the trajectory server refused to release {instance_id}'s "
                                                f"trajectories: {exc}") from None
                    except httpx.HTTPError as exc:
                        if time.monotonic() >= deadline:
                            raise LauncherError(f"the trajectory server refused to release {instance_id}'s "
                                                f"trajectories: {str(exc) or exc.__class__.__name__}") from None
                    time.sleep(0.2)  # retry pacing while the trajectory server restarts

    def _publish(self) -> None:
        from staleflow.launch.job import trainer_label

        (self.state / "endpoints.json").write_text(json.dumps(
            {**self.endpoints, "state_dir": str(self.state.resolve()), "trainer": trainer_label(self.config),
             "token_file": str((self.state / "token").resolve()), "launcher": "ray", "namespace": self.namespace,
             "ray_address": self.address}, indent=2))

    # -- the trainer gang ------------------------------------------------------------------

    def _start_trainer(self) -> None:
        ray = self.ray
        c = self.config.cluster
        world = trainer_world(self.config)
        per_node = world // c.trainer_nodes
        first = self.trainer_bundles[0]
        probe_task = ray.remote(probe)
        master = ray.get(probe_task.options(num_cpus=0, resources=self._marker("trainer"),
                                            scheduling_strategy=self._in("trainer", first)).remote(
            *c.port_range, [v["port"] for v in self.endpoints.values()]), timeout=120)
        Rank = ray.remote(TrainerRank)
        config_json = self.config.model_dump_json()
        ranks = []
        for rank in range(world):
            bundle = self.trainer_bundles[rank // per_node]
            ranks.append(Rank.options(
                name=trainer_rank_name(rank), max_restarts=0, max_concurrency=4, num_cpus=c.cpus_per_rank,
                num_gpus=gpus_per_rank(self.config), resources=self._marker("trainer"),
                scheduling_strategy=self._in("trainer", bundle), **self._options()).remote(
                rank, world, (master["host"], master["port"]), config_json, self.token, self.namespace, self.started))
        self._use_gang(ranks)
        try:
            ray.get([r.state.remote() for r in ranks], timeout=300)
        except ray.exceptions.RayActorError as exc:  # the watcher restarts the gang, as for a rank lost later
            log.warning("a trainer rank died while starting (%s)", exc.__class__.__name__)

    def _write_placement(self) -> None:
        """``<state>/placement.json``: where each actor runs (node, IP, pid, GPU ids), for people
        and tools; rewritten after a gang restart of the trainer."""
        ray = self.ray
        deadline = time.monotonic() + 120
        asks = [(n, a, "info") for n, a in self.actors.items()] + \
               [(trainer_rank_name(i), r, "state") for i, r in enumerate(self.ranks)]
        placement = {}
        for name, actor, method in asks:  # one restarting is waited for; one gone for good is left out
            try:
                info = self._ask(actor, method, deadline)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("placement.json: where %s runs is unknown (%s)", name, exc.__class__.__name__)
                continue
            placement[name] = {k: info[k] for k in ("node_id", "host", "pid", "gpu_ids")}
        (self.state / "placement.json").write_text(json.dumps(placement, indent=2))

    # -- the launcher interface: what the supervisor drives ----------------------------------

    def components(self) -> list[str]:
        return [*self.actors, TRAINER]

    def failed(self) -> dict[str, tuple[str, str]]:
        """Actors whose process died since the supervisor last saw them alive (Ray is restarting
        them, or already has: a new incarnation), one dead for good, and a failed trainer gang."""
        views = actor_views(self.ray)
        gone = {}
        for name, actor in list(self.actors.items()):
            view = views.get(actor._actor_id.hex())
            if not view:
                continue  # Ray cannot say now: asked again next round
            state, incarnation = view.get("State"), _incarnation(view)
            if state == "ALIVE":
                known = self._incarnations.setdefault(name, incarnation)
                if incarnation != known:
                    gone[name] = ("exit", "its process died; Ray restarted it")
            elif state == "DEAD":
                gone[name] = ("exit", "its actor is dead for good (cluster.max_restarts)")
            elif name in self._incarnations:  # RESTARTING (or rescheduling after a node loss)
                gone[name] = ("exit", "its process died; Ray restarts it")
        if self._trainer_failure is not None:
            gone[TRAINER] = self._trainer_failure
        return gone

    def endpoint(self, name: str) -> str | None:
        return None if name == TRAINER else self.endpoints[name]["url"]

    def log_path(self, name: str) -> Path:
        return self.state / "logs" / f"{trainer_rank_name(0) if name == TRAINER else name}.log"

    def restart(self, name: str, standby: Any = None) -> int | None:
        """Bring ``name`` back. Ray restarts an actor whose process died by itself: the launcher
        waits for the new process to answer. An actor alive to Ray (hung, or asked to restart)
        is killed for Ray to restart it. The trainer restarts as a gang."""
        if name == TRAINER:
            self._trainer_restarts += 1
            if self._trainer_restarts > self.config.cluster.trainer_restarts:
                raise BeyondRepair(f"the trainer failed {self._trainer_restarts} times (cluster.trainer_restarts "
                                   f"{self.config.cluster.trainer_restarts}); see {self.log_path(TRAINER)}")
            self.stop_component(TRAINER)
            return self.start_component(TRAINER)
        ray, actor = self.ray, self.actors[name]
        view = actor_views(ray, actor)
        if view.get("State") == "DEAD":
            raise BeyondRepair(f"{name}'s actor is dead for good: Ray restarted it {view.get('NumRestarts')} times "
                               f"(cluster.max_restarts); see {self.log_path(name)} or its Ray worker log")
        deadline = time.monotonic() + self._start_timeout()
        if view.get("State") == "ALIVE" and _incarnation(view) == self._incarnations.get(name):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=False)
            while (v := actor_views(ray, actor)).get("State") == "ALIVE" and _incarnation(v) == _incarnation(view):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not stop when killed")
                self.stop.wait(0.05)  # kill pacing: Ray marks the actor restarting
            view = v
        try:
            info = self._ask(actor, "info", deadline, attempts=1, since=view.get("NumRestarts", 0))
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{name} did not come back in {self._start_timeout():g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"{name} died again while starting ({exc.__class__.__name__}); "
                               f"see {self.log_path(name)}") from None
        now = actor_views(ray, actor)
        if now.get("State") == "ALIVE" and now.get("Pid") == info["pid"]:
            self._incarnations[name] = _incarnation(now)
        else:
            self._incarnations.pop(name, None)  # taken from the next view that shows it alive
        return info["pid"]

    def stop_component(self, name: str) -> None:
        """Kill ``name``'s actor (every rank of the trainer) without a restart by Ray."""
        ray = self.ray
        if name != TRAINER:
            with contextlib.suppress(Exception):
                ray.kill(self.actors[name], no_restart=True)
            self._incarnations.pop(name, None)
            return
        old = self._use_gang([])
        for r in old:
            with contextlib.suppress(Exception):
                ray.kill(r, no_restart=True)
        for rank in range(len(old)):  # the names are free once the old actors are gone
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(trainer_rank_name(rank), namespace=self.namespace)
                except ValueError:
                    break
                self.stop.wait(0.1)  # name release pacing

    def _use_gang(self, ranks: list) -> list:
        """Make ``ranks`` the trainer gang (none: stopped); what the watcher learns of the previous
        gang from now on is stale. Returns the previous gang."""
        with self._gang_lock:
            old, self.ranks = self.ranks, ranks
            self._trainer_generation += 1
            self._trainer_failure = None
        return old

    def start_component(self, name: str, standby: Any = None) -> int | None:
        """Create ``name``'s actor (the trainer: the gang, resuming from its newest checkpoint and
        the step log) and return its process id once it answers."""
        if name != TRAINER:
            self.actors[name] = self._create(name, self.config.model_dump_json())
            self._await([name], self._start_timeout(), None)
            return self._pid_of(name)
        self._start_trainer()
        with contextlib.suppress(Exception):  # a component restarting now: the file is informative only
            self._write_placement()
        with contextlib.suppress(Exception):
            return actor_result(self.ray, self.ranks[0].state.remote(), timeout=30)["pid"]
        return None

    def _pid_of(self, name: str) -> int | None:
        with contextlib.suppress(Exception):
            return actor_result(self.ray, self.actors[name].info.remote(), timeout=30)["pid"]
        return None

    def _start_timeout(self) -> float:
        return self.config.cluster.start_timeout_s or (60.0 if self.config.engine == "sim" else 900.0)

    # -- watching beside the supervisor ----------------------------------------------------

    def _watch(self) -> None:
        """The trainer gang's state and steps, and the registry (components that moved); the
        supervisor acts on what this finds."""
        while not self.stop.is_set():
            try:
                self._check_trainer()
                if self._trainer_done or self.stop.is_set():
                    return
                self._refresh_endpoints()
            except Exception:  # the watcher must not die: log and go on
                log.exception("the Ray launcher's watcher failed a round")
            self.stop.wait(0.5)  # watch pacing

    def _check_trainer(self) -> None:
        ray = self.ray
        with self._gang_lock:
            generation, ranks = self._trainer_generation, list(self.ranks)
        if not ranks:
            return  # between two gangs
        try:
            states = ray.get([r.state.remote() for r in ranks], timeout=30)
            failed = [s for s in states if s["error"]]
            failure = ("error", f"rank {failed[0]['rank']} failed: {failed[0]['error']}") if failed else None
        except ray.exceptions.RayActorError as exc:
            states, failure = [], ("exit", f"a trainer rank died ({exc.__class__.__name__})")
        except ray.exceptions.GetTimeoutError:
            return  # busy or hung: NCCL's own timeout ends a hung collective
        if failure is not None:
            with self._gang_lock:
                if generation != self._trainer_generation:
                    return  # the gang was replaced meanwhile: this is about the old one
                self._trainer_failure = failure
            if self.supervisor is None:  # unsupervised: a failed trainer ends the run
                self._trainer_error = failure[1]
                self.stop.set()
            return
        self._trainer_done = bool(states) and states[0]["done"]
        with contextlib.suppress(Exception):
            self._steps = ray.get(ranks[0].steps.remote(), timeout=30)

    def _refresh_endpoints(self) -> None:
        current = actor_result(self.ray, self.registry.get.remote(), timeout=10)
        changed = {n for n, e in current.items() if self.endpoints.get(n) != e}
        if not changed:
            return
        self.endpoints.update(current)
        self._repoint_pulls()
        self._publish()
        moved_services = changed & set(CONTROL_SERVICES)
        if moved_services:  # everyone else was built with the old address: restart them to read the new one
            why = f"{', '.join(sorted(moved_services))} moved to another node"
            log.warning("%s; restarting the components that call them", why)
            for name in [*self.actors, TRAINER]:
                if name in moved_services:
                    continue
                if self.supervisor is not None:
                    self.supervisor.request(name, "moved", why)
                else:
                    with contextlib.suppress(Exception):
                        self.restart(name)

    def _repoint_pulls(self) -> None:
        """After a relay or an instance moved: each instance pulls from the relay on its node now
        (or from the central parameter server where there is none); the registry and the
        coordinator learn it."""
        from staleflow.api.base import ServiceError
        from staleflow.api.coordinator import CoordinatorClient

        for name, entry in list(self.endpoints.items()):
            if not name.startswith("inst-") or not isinstance(entry, dict):
                continue
            wanted = relay_on(self.endpoints, entry.get("node_id", ""))
            if entry.get("params_url") == wanted:
                continue
            entry = {**{k: v for k, v in entry.items() if k != "params_url"}, **({"params_url": wanted} if wanted else {})}
            self.endpoints[name] = entry
            self.ray.get(self.registry.put.remote(name, entry), timeout=10)
            try:
                with CoordinatorClient(self.endpoints["coordinator"]["url"], token=self.token, timeout=10) as c:
                    c.upsert(name, {"instance_id": name, "url": entry["url"], "params_url": wanted})
            except ServiceError as exc:
                log.error("the coordinator refused %s's new parameter server: %s", name, exc)
            except httpx.HTTPError as exc:  # the coordinator restarting: it reads the registry when it starts
                log.warning("cannot tell the coordinator where %s pulls from: %s", name, exc)

    # -- the surface `staleflow up` uses -----------------------------------------------------

    def finished(self) -> bool:
        return self._trainer_done or self._trainer_error is not None

    @property
    def trainer_error(self) -> str | None:
        return self._trainer_error

    def steps(self) -> list:
        if self._steps:
            return list(self._steps)
        return self.step_log.read() if self.step_log.path.exists() else []

    def write_planned_endpoints(self) -> None:
        """Endpoints are planned on the nodes at start (``start``); nothing to write before."""

    def shutdown(self, release_state_dir: bool = True) -> None:
        self.stop.set()
        if self.supervisor is not None:
            self.supervisor.stop()  # first: nothing stopped below is restarted
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(60)
        with contextlib.suppress(Exception):
            self._steps = self.ray.get(self.ranks[0].steps.remote(), timeout=30) if self.ranks else self._steps
        if self.ray.is_initialized() and self._owner:
            remove_job(self.ray, self.namespace)
        if release_state_dir:
            self.state_lock.release()

    def _remove_groups(self) -> None:
        for pg in self.pgs.values():
            with contextlib.suppress(Exception):
                self.ray.util.remove_placement_group(pg)

    # the job's views read the components over HTTP, wherever they run: the same code as Job's
    def engine_stats(self) -> dict[str, dict]:
        from staleflow.launch.job import Job

        return Job.engine_stats(self)

    def coordinator_stats(self) -> dict | None:
        from staleflow.launch.job import Job

        return Job.coordinator_stats(self)

    def failover(self) -> dict | None:
        from staleflow.launch.job import Job

        return Job.failover(self)

    def length_skew(self, after_step: int = -1) -> dict | None:
        from staleflow.launch.job import Job

        return Job.length_skew(self, after_step)

    def command_times(self) -> dict[str, float]:
        from staleflow.launch.job import Job

        return Job.command_times(self)

    def info(self, name: str) -> dict:
        """Where a component runs now (pid, node, GPUs), from the actor itself."""
        if name.startswith("trainer-"):
            return actor_result(self.ray, self.ranks[int(name.split("-")[1])].state.remote(), timeout=60)
        return actor_result(self.ray, self.actors[name].info.remote(), timeout=60)


def _incarnation(view: dict) -> tuple:
    """Which process of an actor Ray's record is about: (restarts so far, process id)."""
    return view.get("NumRestarts"), view.get("Pid")


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
