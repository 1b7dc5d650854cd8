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
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI

from staleflow.config import JobConfig, LedgerConfig, ManagerConfig
from staleflow.servers.auth import TOKEN_ENV, write_token_file
from staleflow.servers.clients import http_client
from staleflow.servers.http import RunningServer, serve_in_thread
from staleflow.servers.trainer import StepLog, StepRecord, TrainerLoop

log = logging.getLogger(__name__)

STATIC_COMPONENTS = ("manager", "params", "reward", "ts")
STARTED_ENV = "STALEFLOW_JOB_STARTED"  # the job's time.monotonic() at start, for a trainer process


def instance_ids(config: JobConfig) -> list[str]:
    return [f"inst-{i}" for i in range(config.instances)]


def component_names(config: JobConfig) -> list[str]:
    """Start order: each component only needs those before it."""
    return [*STATIC_COMPONENTS, *instance_ids(config), "coordinator"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def in_own_process(name: str, config: JobConfig) -> bool:
    """vLLM instances always get a process each: one engine per process."""
    return config.processes or (config.engine != "sim" and name.startswith("inst-"))


def plan_endpoints(config: JobConfig) -> dict[str, dict]:
    endpoints = {}
    for offset, name in enumerate(component_names(config)):
        port = config.base_port + offset if config.base_port else _free_port(config.host)
        endpoints[name] = {"url": f"http://{config.host}:{port}", "host": config.host, "port": port}
    return endpoints


def model_dir(config: JobConfig) -> Path:
    from staleflow.training.demo import resolve_model

    return resolve_model(config)


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
        real = config.engine != "sim"
        return create_app(TrajectoryServerConfig(
            ledger=ledger, manager_url=url["manager"], state_dir=state, seed=config.seed, reward=reward,
            sampling=SamplingConfig(max_tokens=config.max_tokens), dataset=config.dataset, task=config.task,
            tokenizer=model_dir(config) if real else None))
    if name.startswith("inst-"):
        from staleflow.servers.instance import InstanceConfig, SimConfig, create_app

        index = int(name.split("-")[1])
        callback = f"{url['ts']}/v1/completed"
        if config.engine == "vllm":
            from staleflow.servers.instance import VllmConfig

            vllm = VllmConfig(**{"seed": config.seed + index, **config.vllm_args, "model": str(model_dir(config))})
            return create_app(InstanceConfig(instance_id=name, engine="vllm", vllm=vllm, completion_callback_url=callback))
        sim = SimConfig(workload=config.workload, workload_seed=config.seed, seed=config.seed + index,
                        clock="real", speed=config.speed, kv_budget=config.kv_budget)
        return create_app(InstanceConfig(instance_id=name, engine=config.engine, sim=sim, completion_callback_url=callback))
    if name == "coordinator":
        from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint, create_app

        return create_app(CoordinatorConfig(
            manager_url=url["manager"], ts_url=url["ts"], params_url=url["params"],
            instances=[InstanceEndpoint(instance_id=i, url=url[i], params_url=endpoints[i].get("params_url"))
                       for i in instance_ids(config)],
            routing=config.routing, sync=config.sync, migration=config.migration, mu=config.mu,
            phi_wait=config.phi_wait, phi_throughput=config.phi_throughput, cycle_period=config.cycle_period,
            # a real engine on a busy CPU can take tens of seconds for a step or a weight load
            failure_timeout=max(5.0, 20 * config.cycle_period) if config.engine == "sim" else 60.0,
            calibration=config.calibration,
            **({} if config.engine == "sim" else {"command_timeout": 120.0, "stall_timeout": 120.0})))
    raise ValueError(f"unknown component {name!r}; components are {', '.join(component_names(config))}")


# ---------------------------------------------------------------------------- the trainer

TRAINER = "trainer"


def trainer_in_process(config: JobConfig) -> bool:
    """The real trainer always runs as processes of its own (torch.distributed ranks)."""
    return config.processes or config.engine != "sim"


def trainer_label(config: JobConfig) -> str:
    if config.engine == "sim":
        from staleflow.training.simulated import SimulatedBackend

        return SimulatedBackend.label
    return f"FSDP2 trainer ({config.trainer.world_size} ranks, {config.trainer.algorithm.correction} correction)"


def step_log(config: JobConfig) -> StepLog:
    return StepLog(config.state_dir / "trainer" / "steps.jsonl")


def run_trainer(config: JobConfig, endpoints: dict[str, dict], stop: threading.Event, started: float | None = None) -> None:
    """The trainer role until ``config.steps`` buffers are trained (or ``stop``)."""
    urls = {k: v["url"] for k, v in endpoints.items()}
    if config.engine == "sim":
        from staleflow.training.simulated import SimulatedBackend

        t = config.trainer
        backend = SimulatedBackend(t.seconds_per_step, t.seconds_per_token, t.push_bytes, config.speed, stop)
        TrainerLoop(backend, steps=config.steps, eta=config.ledger.eta, urls=urls, step_log=step_log(config),
                    stop=stop, started=started).run()
        return
    from staleflow.servers.trainer import run_fsdp_trainer

    run_fsdp_trainer(config, urls, step_log(config), stop, started)


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
        self.procs: dict[str, subprocess.Popen] = {}  # by component name, the newest process of each
        self.step_log = step_log(config)
        self.monitor = Monitor(self.endpoints, self.started)
        self.trainer_thread: threading.Thread | None = None
        self.trainer_process: subprocess.Popen | None = None
        self._trainer_error: BaseException | None = None

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
        launched: list[tuple[str, subprocess.Popen, Path]] = []
        for name in component_names(self.config):
            if name == "coordinator":  # instances start side by side (a vLLM engine takes a while)
                for item in launched:
                    self._await_up(*item)
                    if on_started:
                        on_started(item[0], self.endpoints[item[0]]["url"])
            if in_own_process(name, self.config) and name.startswith("inst-"):
                launched.append(self._launch(name))
                continue
            if in_own_process(name, self.config):
                self._spawn(name)
            else:
                self.servers.append(serve_in_thread(build_app(name, self.config, self.endpoints),
                                                    self.config.host, self.endpoints[name]["port"], token=self.token))
            if name == "ts":
                self._release_previous_instances()
            if on_started:
                on_started(name, self.endpoints[name]["url"])
        (self.state / "endpoints.json").write_text(json.dumps(
            {**self.endpoints, "state_dir": str(self.state.resolve()), "trainer": trainer_label(self.config),
             "token_file": str((self.state / "token").resolve())}, indent=2))
        # the clock of the run starts once everything is up: start-up is not rollout time
        self.started = self.monitor.started = time.monotonic()
        if trainer_in_process(self.config):
            self.trainer_process = self._spawn(TRAINER)
        else:
            self.trainer_thread = threading.Thread(target=self._train, name=TRAINER, daemon=True)
            self.trainer_thread.start()
        if on_started:
            on_started(TRAINER, trainer_label(self.config))

    def _train(self) -> None:
        try:
            run_trainer(self.config, self.endpoints, self.stop, self.started)
        except BaseException as exc:  # surfaced by the job, not lost in a thread
            self._trainer_error = exc
            self.stop.set()

    def _spawn(self, name: str) -> subprocess.Popen:
        return self._await_up(*self._launch(name))

    def _launch(self, name: str) -> tuple[str, subprocess.Popen, Path]:
        log_path = self.state / "logs" / f"{name}.log"
        if not (self.state / "endpoints.planned.json").exists():
            self.write_planned_endpoints()
        with log_path.open("a") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "staleflow.cli", "serve", "component", name, "--job", str(self.state / "job.json"),
                 "--endpoints", str(self.state / "endpoints.planned.json")],
                stdout=log_file, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, STARTED_ENV: repr(self.started)})
        return name, proc, log_path

    def _await_up(self, name: str, proc: subprocess.Popen, log_path: Path) -> subprocess.Popen:
        self.processes.append(proc)
        self.procs[name] = proc
        if name == TRAINER:
            return proc  # no endpoint: the job watches its process and its step log
        limit = 60 if self.config.engine == "sim" else 900  # a vLLM engine on a busy CPU starts slowly
        with http_client(self.endpoints[name]["url"], timeout=2) as probe:
            deadline = time.monotonic() + limit
            while True:  # the child binds, then serves: wait until it answers
                if proc.poll() is not None:
                    raise RuntimeError(f"component {name} exited with {proc.returncode}; see {log_path}")
                try:
                    if probe.get("/v1/health").status_code == 200:
                        return proc
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"component {name} did not come up in {limit} s; see {log_path}")
                self.stop.wait(0.05)

    # -- one role at a time (the fault supervisor's hooks; --processes only) -------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Send ``sig`` to component ``name``'s process (SIGKILL: a crash; SIGSTOP: a hang)."""
        proc = self.procs[name]
        proc.send_signal(sig)
        return proc

    def restart(self, name: str, standby: subprocess.Popen | None = None) -> None:
        """Start component ``name`` again at its planned port, after its process died or was
        killed; returns once it answers its health probe. A warm ``standby`` process (see
        ``staleflow.launch.standby``) takes the role without a cold start."""
        old = self.procs[name]
        if old.poll() is None:
            old.kill()
        old.wait()
        self.processes.remove(old)
        if standby is None:
            proc = self._spawn(name)
        else:
            assert standby.stdin is not None
            standby.stdin.write(json.dumps({"name": name, "job": str(self.state / "job.json"),
                                            "endpoints": str(self.state / "endpoints.planned.json"),
                                            "started": self.started}) + "\n")
            standby.stdin.flush()
            proc = self._await_up(name, standby, self.state / "logs" / f"{name}.log")
        if name == TRAINER:
            self.trainer_process = proc

    def write_planned_endpoints(self) -> None:
        (self.state / "endpoints.planned.json").write_text(json.dumps(self.endpoints, indent=2))

    def _release_previous_instances(self) -> None:
        """Trajectories routed to instances of a previous run go back to pending."""
        with http_client(self.endpoints["ts"]["url"]) as ts:
            for instance_id in instance_ids(self.config):
                ts.post(f"/v1/instances/{instance_id}/release")

    def finished(self) -> bool:
        if self.trainer_process is not None:
            return self.trainer_process.poll() is not None
        return self.trainer_thread is not None and not self.trainer_thread.is_alive()

    @property
    def trainer_error(self) -> str | None:
        if self._trainer_error is not None:
            return repr(self._trainer_error)
        if self.trainer_process is not None and self.trainer_process.poll() not in (None, 0):
            if not self.stop.is_set():
                return f"the trainer process exited with {self.trainer_process.returncode}; see {self.state / 'logs' / 'trainer.log'}"
        return None

    def steps(self) -> list[StepRecord]:
        return self.step_log.read()

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
        if self.trainer_process is not None and self.trainer_process.poll() is None:
            self.trainer_process.terminate()  # it saves nothing mid-step: its checkpoints are its state
            try:
                self.trainer_process.wait(30)
            except subprocess.TimeoutExpired:
                self.trainer_process.kill()
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
