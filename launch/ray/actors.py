"""What runs on the nodes of a Ray job: each component as an actor serving its app
(``Component``), each trainer rank (``TrainerRank``), the endpoints registry (``Registry``), and
the probe that finds a component's address on the node that will serve it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from staleflow.config import JobConfig
from staleflow.launch.plan import build_app, model_dir, run_trainer, step_log
from staleflow.launch.ray.common import (
    REGISTRY,
    LauncherError,
    actor_result,
    is_relay,
    join_url,
    relay_on,
    start_timeout,
    trainer_rank_name,
)
from staleflow.ports import free_port_between

log = logging.getLogger(__name__)


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def port_in_range(host: str, low: int, high: int, taken: set[int] | frozenset = frozenset()) -> int:
    """A port free on ``host`` now, from [low, high], not in ``taken``; tried from a random start
    so that launchers on one node rarely race for the same port."""
    port = free_port_between(host, low, high, taken)
    if port is None:
        raise LauncherError(f"no free port on {host} in {low}-{high}; widen cluster.port_range")
    return port


def probe(low: int, high: int, taken: list[int]) -> dict:
    """Run inside a component's placement: where it will serve."""
    import ray

    host = node_ip()
    return {"host": host, "port": port_in_range(host, low, high, set(taken)),
            "node_id": ray.get_runtime_context().get_node_id()}


def relay_app(config: JobConfig, namespace: str, name: str, token: str, upstream: str | None = None):
    """A relay's parameter server, its versions in node-local storage (shared memory serves them),
    in a directory of this run's own (named after its token's hash): a later job in the same
    namespace must never find this one's versions there. Its egress limit is the job's
    (``params.egress_gbps``), as the parameter server's. With ``params.sources: ros`` the relay is
    a holder of the job's parameter server (``upstream``): it pulls each version from its holders
    and serves what it holds to the other nodes' relays, on its node's address."""
    import hashlib
    import tempfile

    from staleflow.servers.params import ParamsConfig, create_app

    run = hashlib.sha256(token.encode()).hexdigest()[:12]
    where = Path(tempfile.gettempdir()) / f"staleflow-relay-{namespace}-{name}-{run}"
    holder = ({"holder_of": upstream, "holder_id": f"{namespace}-{name}", "host": node_ip(),
               "holder_ttl_s": config.params.holder_ttl_s} if config.params.sources == "ros" and upstream else {})
    return create_app(ParamsConfig(state_dir=where, keep=3, fsync=False, egress_gbps=config.params.egress_gbps,
                                   **holder))


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
        timeout = start_timeout(config)
        self.server = None
        if not moved:
            try:
                self.server = serve_in_thread(app, here, planned["port"], token=token, startup_timeout=timeout)
            except OSError:  # someone took the port since: serve on another one, like a moved component
                moved = True
                app = make_app()
        if moved:
            port = port_in_range(here, *config.cluster.port_range)
            endpoints[name] = {"url": join_url(here, port), "host": here, "port": port, "node_id": node_id}
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
                run_trainer(self.config, self.endpoints, self.stop_event, self.started)
            else:
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
        return step_log(self.config).read()

    def stop(self) -> None:
        self.stop_event.set()
