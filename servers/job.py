"""`staleflow up`: a whole StaleFlow job on one machine.

The components (staleness manager, parameter server, reward server, trajectory server, rollout
instances, coordinator) are built from one ``JobConfig`` and one endpoints map, so the same
configuration runs them embedded (threads of this process) or as processes of their own
(``staleflow serve component NAME --job FILE``). A trainer consumes Ready buffers; with the
``sim`` engine it is a simulated trainer with a step-time model, clearly labelled as such.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fastapi import FastAPI

from staleflow.config import JobConfig, LedgerConfig, ManagerConfig
from staleflow.servers.auth import TOKEN_ENV, write_token_file
from staleflow.servers.clients import ManagerClient, ServiceError, http_client
from staleflow.servers.http import RunningServer, serve_in_thread

log = logging.getLogger(__name__)

STATIC_COMPONENTS = ("manager", "params", "reward", "ts")


def instance_ids(config: JobConfig) -> list[str]:
    return [f"inst-{i}" for i in range(config.instances)]


def component_names(config: JobConfig) -> list[str]:
    """Start order: each component only needs those before it."""
    return [*STATIC_COMPONENTS, *instance_ids(config), "coordinator"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_endpoints(config: JobConfig) -> dict[str, dict]:
    endpoints = {}
    for offset, name in enumerate(component_names(config)):
        port = config.base_port + offset if config.base_port else _free_port(config.host)
        endpoints[name] = {"url": f"http://{config.host}:{port}", "host": config.host, "port": port}
    return endpoints


def build_app(name: str, config: JobConfig, endpoints: dict[str, dict]) -> FastAPI:
    """The FastAPI app of one component of the job."""
    state = config.state_dir
    url = {k: v["url"] for k, v in endpoints.items()}
    ledger = config.ledger
    if name == "manager":
        from staleflow.servers.manager import create_app

        return create_app(ManagerConfig(ledger=ledger, state_dir=state))
    if name == "params":
        from staleflow.servers.params import ParamsConfig, create_app

        return create_app(ParamsConfig(state_dir=state / "params", keep=3, fsync=False))
    if name == "reward":
        from staleflow.servers.reward import RewardConfig, create_app

        return create_app(RewardConfig())
    if name == "ts":
        from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig, create_app

        reward = config.reward
        if reward == "auto":
            reward = "sim" if config.engine == "sim" else url["reward"]
        return create_app(TrajectoryServerConfig(
            ledger=ledger, manager_url=url["manager"], state_dir=state, seed=config.seed, reward=reward,
            sampling=SamplingConfig(max_tokens=config.max_tokens)))
    if name.startswith("inst-"):
        from staleflow.servers.instance import InstanceConfig, SimConfig, create_app

        index = int(name.split("-")[1])
        sim = SimConfig(workload=config.workload, workload_seed=config.seed, seed=config.seed + index,
                        clock="real", speed=config.speed)
        return create_app(InstanceConfig(instance_id=name, engine=config.engine, sim=sim,
                                         completion_callback_url=f"{url['ts']}/v1/completed"))
    if name == "coordinator":
        from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint, create_app

        return create_app(CoordinatorConfig(
            manager_url=url["manager"], ts_url=url["ts"], params_url=url["params"],
            instances=[InstanceEndpoint(instance_id=i, url=url[i]) for i in instance_ids(config)],
            routing=config.routing, sync=config.sync, migration=config.migration, mu=config.mu,
            phi_wait=config.phi_wait, phi_throughput=config.phi_throughput, cycle_period=config.cycle_period,
            failure_timeout=max(5.0, 20 * config.cycle_period),
            calibration=config.calibration))
    raise ValueError(f"unknown component {name!r}; components are {', '.join(component_names(config))}")


# ---------------------------------------------------------------------------- the trainer


@dataclass
class StepRecord:
    version: int
    finished_at: float  # seconds since the job started (wall clock)
    groups: int
    trajectories: int
    response_tokens: int
    mean_reward: float
    mean_length: float
    max_length: int
    staleness: dict[int, int]  # V_buf - V_traj -> count
    train_seconds: float  # simulated


class SimulatedTrainer:
    """Stands in for the FSDP trainer with the sim engine: consumes a Ready buffer, fetches its
    batch, 'trains' for (seconds_per_step + seconds_per_token x tokens) simulated seconds, pushes
    the next version to the parameter server, frees the batch."""

    label = "simulated trainer (step-time model)"

    def __init__(self, config: JobConfig, endpoints: dict[str, dict], started: float, stop: threading.Event):
        self.config = config
        self.urls = {k: v["url"] for k, v in endpoints.items()}
        self.started = started
        self.stop = stop
        self.steps: list[StepRecord] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the job, not lost in a thread
            self.error = exc
            self.stop.set()

    def _run(self) -> None:
        from staleflow.servers.params import ParamsClient

        cfg, eta = self.config, self.config.ledger.eta
        with ManagerClient(self.urls["manager"]) as manager, http_client(self.urls["ts"], timeout=60) as ts, \
                ParamsClient(self.urls["params"]) as params:
            version = manager.buffers()["train_version"]
            for stale in range(max(0, version - eta - 1), version):  # batches left unfreed by a previous run
                ts.delete(f"/v1/batches/{stale}")
            while version < cfg.steps and not self.stop.is_set():
                try:
                    step = manager.consume()
                except ServiceError as exc:
                    if exc.status != 409:
                        raise
                    self.stop.wait(0.02)  # poll pacing: the buffer is not Ready yet
                    continue
                version = step["version"]
                batch = ts.get(f"/v1/batches/{version}").json()
                trajs = batch["trajectories"]
                lengths = [len(t["tokens"]) for t in trajs]
                staleness: dict[int, int] = {}
                for t in trajs:
                    staleness[version - t["v_traj"]] = staleness.get(version - t["v_traj"], 0) + 1
                tokens = sum(lengths)
                train_seconds = cfg.trainer.seconds_per_step + cfg.trainer.seconds_per_token * tokens
                self.stop.wait(train_seconds / cfg.speed)  # the modelled training time
                params.push(version + 1, {"weights": np.full(cfg.trainer.push_bytes, (version + 1) % 256, np.uint8)})
                ts.delete(f"/v1/batches/{version}")
                self.steps.append(StepRecord(
                    version, time.monotonic() - self.started, len(step["group_ids"]), len(trajs), tokens,
                    float(np.mean([t["reward"] for t in trajs])) if trajs else 0.0,
                    float(np.mean(lengths)) if lengths else 0.0, max(lengths, default=0), staleness, train_seconds))
                version += 1


# ---------------------------------------------------------------------------- monitoring


@dataclass
class Sample:
    t: float
    instances: dict[str, dict]  # id -> {status, version, running, waiting}
    buffers: list[dict]
    train_version: int


@dataclass
class Monitor:
    endpoints: dict[str, dict]
    started: float
    samples: list[Sample] = field(default_factory=list)

    def sample(self) -> Sample | None:
        urls = {k: v["url"] for k, v in self.endpoints.items()}
        try:
            with http_client(urls["coordinator"], timeout=5) as co, http_client(urls["manager"], timeout=5) as mg:
                instances = {
                    i["instance_id"]: {
                        "status": i["status"],
                        "version": (i["snapshot"] or {}).get("inst_version"),
                        "running": len((i["snapshot"] or {}).get("run_trajs") or []),
                        "waiting": len((i["snapshot"] or {}).get("wait_trajs") or []),
                        "throughput": i["estimated_throughput"],
                    }
                    for i in co.get("/v1/instances").json()["instances"]
                }
                buffers = mg.get("/v1/buffers").json()
        except Exception as exc:  # a component restarting or shutting down
            log.debug("monitor sample failed: %s", exc)
            return None
        s = Sample(time.monotonic() - self.started, instances, buffers["buffers"], buffers["train_version"])
        self.samples.append(s)
        return s


# ---------------------------------------------------------------------------- the job


class StateDirInUse(RuntimeError):
    pass


class Job:
    def __init__(self, config: JobConfig, resume: bool = False, fresh: bool = False):
        self.config = config
        self.state = config.state_dir
        self._prepare_state_dir(resume, fresh)
        self.endpoints = plan_endpoints(config)
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.servers: list[RunningServer] = []
        self.processes: list[subprocess.Popen] = []
        self.trainer = SimulatedTrainer(config, self.endpoints, self.started, self.stop)
        self.monitor = Monitor(self.endpoints, self.started)
        self.trainer_thread: threading.Thread | None = None

    def _prepare_state_dir(self, resume: bool, fresh: bool) -> None:
        previous = self.state / "job.json"
        if previous.exists() and not resume:
            finished = (self.state / "report" / "summary.json").exists()
            if not (fresh or finished):
                raise StateDirInUse(
                    f"{self.state} holds an unfinished run; continue it with --resume, or start over with --fresh")
            shutil.rmtree(self.state)
        if resume and previous.exists():
            before = JobConfig.model_validate_json(previous.read_text())
            if before.ledger != self.config.ledger:
                raise StateDirInUse(f"{self.state} was created with {before.ledger}; resume needs the same ledger settings")
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "logs").mkdir(exist_ok=True)
        (self.state / "job.json").write_text(self.config.model_dump_json(indent=2))

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, on_started: Callable[[str, str], None] | None = None) -> None:
        # every run gets a fresh token; components, the trainer and child processes read it from
        # the environment, other tools from the owner-only token file named in endpoints.json
        self.token = write_token_file(self.state / "token")
        self._previous_token = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = self.token  # restored by shutdown()
        for name in component_names(self.config):
            if self.config.processes:
                self._spawn(name)
            else:
                self.servers.append(serve_in_thread(build_app(name, self.config, self.endpoints),
                                                    self.config.host, self.endpoints[name]["port"], token=self.token))
            if name == "ts":
                self._release_previous_instances()
            if on_started:
                on_started(name, self.endpoints[name]["url"])
        (self.state / "endpoints.json").write_text(json.dumps(
            {**self.endpoints, "state_dir": str(self.state.resolve()), "trainer": SimulatedTrainer.label,
             "token_file": str((self.state / "token").resolve())}, indent=2))
        # the clock of the run starts once everything is up: start-up is not rollout time
        self.started = self.trainer.started = self.monitor.started = time.monotonic()
        self.trainer_thread = threading.Thread(target=self.trainer.run, name="trainer", daemon=True)
        self.trainer_thread.start()

    def _spawn(self, name: str) -> None:
        log_path = self.state / "logs" / f"{name}.log"
        log_file = log_path.open("a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "staleflow.cli", "serve", "component", name, "--job", str(self.state / "job.json"),
             "--endpoints", str(self.state / "endpoints.planned.json")],
            stdout=log_file, stderr=subprocess.STDOUT, text=True)
        self.processes.append(proc)
        with http_client(self.endpoints[name]["url"], timeout=2) as probe:
            deadline = time.monotonic() + 60
            while True:  # the child binds, then serves: wait until it answers
                if proc.poll() is not None:
                    raise RuntimeError(f"component {name} exited with {proc.returncode}; see {log_path}")
                try:
                    if probe.get("/v1/health").status_code == 200:
                        return
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"component {name} did not come up in 60 s; see {log_path}")
                self.stop.wait(0.05)

    def write_planned_endpoints(self) -> None:
        (self.state / "endpoints.planned.json").write_text(json.dumps(self.endpoints, indent=2))

    def _release_previous_instances(self) -> None:
        """Trajectories routed to instances of a previous run go back to pending."""
        with http_client(self.endpoints["ts"]["url"]) as ts:
            for instance_id in instance_ids(self.config):
                ts.post(f"/v1/instances/{instance_id}/release")

    def finished(self) -> bool:
        return self.trainer_thread is not None and not self.trainer_thread.is_alive()

    def shutdown(self) -> None:
        self.stop.set()
        try:
            self._stop_components()
        finally:
            if getattr(self, "token", None) is not None:
                if self._previous_token is None:
                    os.environ.pop(TOKEN_ENV, None)
                else:
                    os.environ[TOKEN_ENV] = self._previous_token

    def _stop_components(self) -> None:
        if self.trainer_thread:
            self.trainer_thread.join(30)
        for server in reversed(self.servers):
            server.stop()
        for proc in reversed(self.processes):
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- what happened ---------------------------------------------------------------------

    def engine_stats(self) -> dict[str, dict]:
        stats = {}
        for name in instance_ids(self.config):
            try:
                with http_client(self.endpoints[name]["url"], timeout=5) as c:
                    stats[name] = c.get("/v1/stats").json()
            except Exception as exc:
                log.debug("no stats from %s: %s", name, exc)
        return stats

    def command_times(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        try:
            with http_client(self.endpoints["coordinator"]["url"], timeout=5) as c:
                for cmd in c.get("/v1/commands", params={"limit": 2000}).json()["commands"]:
                    if cmd["completed_at"]:
                        totals[cmd["kind"]] = totals.get(cmd["kind"], 0.0) + cmd["completed_at"] - cmd["issued_at"]
                stats = c.get("/v1/coordinator").json()
        except Exception:
            return totals
        totals["mean_decision_ms"] = stats["mean_decision_ms"]
        return totals


def ledger_config_from(state_dir: Path) -> LedgerConfig | None:
    path = state_dir / "job.json"
    return JobConfig.model_validate_json(path.read_text()).ledger if path.exists() else None
