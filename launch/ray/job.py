"""``RayClusterJob``: the Ray launcher. It places the job's placement groups, plans each
component's address on its node, starts the components and the trainer gang as actors, watches
them beside the supervisor, and answers the job's views (``JobViews``) over its endpoints."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from staleflow.config import JobConfig, NodeSelector
from staleflow.launch.launcher import BeyondRepair
from staleflow.launch.plan import TRAINER, component_names, instance_ids, step_log, trainer_label
from staleflow.launch.ray.actors import Component, Registry, TrainerRank, probe
from staleflow.launch.ray.common import (
    CONTROL_SERVICES,
    PLACEMENT_GROUPS,
    REGISTRY,
    LauncherError,
    actor_result,
    actor_views,
    import_ray,
    is_relay,
    join_url,
    named_actors,
    namespace_of,
    relay_on,
    remove_job,
    start_timeout,
    trainer_rank_name,
    trainer_world,
)
from staleflow.launch.ray.placement import (
    PLACEMENT_ORDER,
    RESOURCE_SHARE,
    PlacementPlan,
    gpus_per_instance,
    gpus_per_rank,
    need_text,
    preflight,
    selector_text,
)
from staleflow.launch.state_lock import take_state_dir
from staleflow.launch.supervisor import Supervised
from staleflow.launch.views import JobViews, Monitor

log = logging.getLogger(__name__)

START_ATTEMPTS = 5  # restarts of a component that never comes up before the start-up gives up on it


class RayClusterJob(Supervised, JobViews):
    """A job whose components are Ray actors; the surface of ``LocalJob`` that ``staleflow up`` uses,
    and a ``staleflow.launch.launcher.Launcher`` for the job's supervisor."""

    check_interval_s = 0.5  # one look at Ray's actor table per round
    keeps_standby = False  # Ray starts each actor's process itself: no warm standby takes a role
    parallel_restarts = True  # Ray restarts them side by side; the supervisor waits for each

    def __init__(self, config: JobConfig, resume: bool = False, fresh: bool = False,
                 address: str | None = None, namespace: str | None = None):
        self.ray = import_ray()
        self.resume = resume
        self.config = config
        self.state = config.state_dir
        self.namespace = namespace or namespace_of(config)
        self.address = address or config.cluster.address or os.environ.get("RAY_ADDRESS") or "auto"
        self.state_lock = take_state_dir(config, resume, fresh)  # the same lock and rules as a local run
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
        timeout = self._start_timeout()
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
        timeout = self._start_timeout()
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
                    f"placement group {group} ({len(bundles)} × {need_text(bundles[0])}, {strategy}) was not placed in "
                    f"{c.placement_timeout_s:g} s on the {selector_text(group, selector)}: the cluster lacks free room "
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
            planned[name] = {"url": join_url(where["host"], where["port"]), "host": where["host"], "port": where["port"],
                             "node_id": where["node_id"]}
            if name.startswith("inst-") and (relay := relay_on(planned, where["node_id"])):
                planned[name]["params_url"] = relay
        return planned

    def _names(self) -> list[str]:
        """Start order: the control services, the relays, the instances, the coordinator."""
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

        timeout = self._start_timeout()
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
        # the restart that counts is the one after the process the supervisor last saw alive: a view
        # taken while Ray has not yet counted the restart it is making (or could not answer) would
        # make that restart look like a second death
        known = self._incarnations.get(name, (None, None))[0]
        since = known + 1 if known is not None else view.get("NumRestarts", 0)
        try:
            info = self._ask(actor, "info", deadline, attempts=1, since=since)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{name} did not come back in {self._start_timeout():g} s") from None
        except ray.exceptions.RayActorError as exc:
            now = actor_views(ray, actor)
            raise RuntimeError(f"{name} died again while starting ({exc.__class__.__name__}; Ray's restart "
                               f"{now.get('NumRestarts')}, {now.get('State')}, counted from {since}); "
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
        return start_timeout(self.config)

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

    def info(self, name: str) -> dict:
        """Where a component runs now (pid, node, GPUs), from the actor itself."""
        if name.startswith("trainer-"):
            return actor_result(self.ray, self.ranks[int(name.split("-")[1])].state.remote(), timeout=60)
        return actor_result(self.ray, self.actors[name].info.remote(), timeout=60)


def _incarnation(view: dict) -> tuple:
    """Which process of an actor Ray's record is about: (restarts so far, process id)."""
    return view.get("NumRestarts"), view.get("Pid")
