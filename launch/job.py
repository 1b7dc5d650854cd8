"""`staleflow up`: a whole StaleFlow job on one machine.

The components (staleness manager, parameter server, reward server, trajectory server, rollout
instances, coordinator) are built from one ``JobConfig`` and one endpoints map, so the same
configuration runs them embedded (threads of this process) or as processes of their own
(``staleflow serve component NAME --job FILE``). A trainer consumes Ready buffers; with the
``sim`` engine it is a simulated trainer with a step-time model, clearly labelled as such.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from fastapi import FastAPI

from staleflow.api.base import ServiceClient, ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.instance import InstanceClient
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import JobConfig
from staleflow.launch.launcher import ComponentStuck, Supervised, exit_cause
from staleflow.launch.state_lock import StateDirInUse, StateDirLock, clear_state_dir
from staleflow.servers.auth import TOKEN_ENV, run_token
from staleflow.servers.http import RunningServer, free_port, serve_in_thread
from staleflow.training.role import StepLog, StepRecord, run_trainer_role

log = logging.getLogger(__name__)

STATIC_COMPONENTS = ("manager", "params", "reward", "ts")
STARTED_ENV = "STALEFLOW_JOB_STARTED"  # the job's time.monotonic() at start, for a trainer process


def instance_ids(config: JobConfig) -> list[str]:
    return [f"inst-{i}" for i in range(config.instances)]


def component_names(config: JobConfig) -> list[str]:
    """Start order: each component only needs those before it."""
    return [*STATIC_COMPONENTS, *instance_ids(config), "coordinator"]


def in_own_process(name: str, config: JobConfig) -> bool:
    """vLLM instances always get a process each: one engine per process."""
    return config.processes or (config.engine != "sim" and name.startswith("inst-"))


def plan_endpoints(config: JobConfig) -> dict[str, dict]:
    endpoints = {}
    for offset, name in enumerate(component_names(config)):
        port = config.base_port + offset if config.base_port else free_port(config.host)
        endpoints[name] = {"url": f"http://{config.host}:{port}", "host": config.host, "port": port}
    return endpoints


def model_dir(config: JobConfig) -> Path:
    from staleflow.training.demo import resolve_model

    return resolve_model(config)


def build_app(name: str, config: JobConfig, endpoints: dict[str, dict]) -> FastAPI:
    """The FastAPI app of one component of the job, with the config ``JobConfig`` composes for it."""
    url = {k: v["url"] for k, v in endpoints.items()}
    model = model_dir(config) if config.engine != "sim" and (name == "ts" or name.startswith("inst-")) else None
    if name == "manager":
        from staleflow.servers.manager import create_app as manager_app

        return manager_app(config.manager_config())
    if name == "params":
        from staleflow.servers.params import create_app as params_app

        return params_app(config.params_config())
    if name == "reward":
        from staleflow.servers.reward import create_app as reward_app

        return reward_app(config.reward_config())
    if name == "ts":
        from staleflow.servers.trajectories import create_app as ts_app

        return ts_app(config.trajectories_config(url, tokenizer=model))
    if name.startswith("inst-"):
        from staleflow.servers.instance import create_app as instance_app

        return instance_app(config.instance_config(name, url, model))
    if name == "coordinator":
        from staleflow.coordinator.app import create_app as coordinator_app

        return coordinator_app(config.coordinator_config(
            url, instance_ids(config), {i: endpoints[i].get("params_url") for i in instance_ids(config)}))
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
    return StepLog(config.trainer_role_config().step_log_path)


def run_trainer(config: JobConfig, endpoints: dict[str, dict], stop: threading.Event, started: float | None = None) -> None:
    """The trainer role until ``config.steps`` buffers are trained (or ``stop``), with its section of the job."""
    urls = {k: v["url"] for k, v in endpoints.items()}
    role = config.trainer_role_config(None if config.engine == "sim" else model_dir(config))
    run_trainer_role(role, urls, stop, started)


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
            with CoordinatorClient(urls["coordinator"], timeout=5) as co, ManagerClient(urls["manager"], timeout=5) as mg:
                instances = {
                    i.instance_id: {
                        "status": i.status,
                        "version": (i.snapshot or {}).get("inst_version"),
                        "running": len((i.snapshot or {}).get("run_trajs") or []),
                        "waiting": len((i.snapshot or {}).get("wait_trajs") or []),
                        "throughput": i.estimated_throughput,
                    }
                    for i in co.instances().instances
                }
                buffers = mg.buffers()
        except Exception as exc:  # a component restarting or shutting down
            log.debug("monitor sample failed: %s", exc)
            return None
        s = Sample(time.monotonic() - self.started, instances,
                   [b.model_dump(exclude_none=True) for b in buffers.buffers], buffers.train_version)
        self.samples.append(s)
        return s


# ---------------------------------------------------------------------------- the job


class RunningJob(Protocol):
    """What the job's read views (``Job.engine_stats`` and the others below) use of a launcher's job:
    the Ray launcher runs the same views over its own endpoints."""

    config: JobConfig
    state: Path
    state_lock: StateDirLock
    endpoints: dict[str, dict]

    def coordinator_stats(self) -> dict | None: ...


class TrackedJob(RunningJob, Protocol):
    """What ``JobTracking`` reads of a launcher's job, local or on Ray."""

    def length_skew(self, after_step: int = -1) -> dict | None: ...


class SummarizedJob(Protocol):
    """What ``job_summary`` reads of a launcher's job, local or on Ray."""

    started: float
    monitor: Monitor

    def steps(self) -> list[StepRecord]: ...
    def engine_stats(self) -> dict[str, dict]: ...
    def command_times(self) -> dict[str, float]: ...
    def failover(self) -> dict | None: ...
    def length_skew(self, after_step: int = -1) -> dict | None: ...


class Job(Supervised):
    """A job on this machine: each component a thread of this process (embedded) or a process of
    its own (``--processes``; always a vLLM instance and the FSDP trainer). It implements
    ``staleflow.launch.launcher.Launcher``, for the supervisor."""

    state_lock: StateDirLock  # taken by _prepare_state_dir

    check_interval_s = 0.1  # process exits and stopped threads are looked for this often
    parallel_restarts = False  # one at a time: a restart takes the warm standby

    def __init__(self, config: JobConfig, resume: bool = False, fresh: bool = False):
        self.config = config
        self.state = config.state_dir
        self._prepare_state_dir(resume, fresh)
        self.endpoints = plan_endpoints(config)
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.servers: dict[str, RunningServer] = {}  # components that are threads of this process, by name
        self.processes: list[subprocess.Popen] = []
        self.procs: dict[str, subprocess.Popen] = {}  # by component name, the newest process of each
        self.step_log = step_log(config)
        self.monitor = Monitor(self.endpoints, self.started)
        self.trainer_thread: threading.Thread | None = None
        self.trainer_process: subprocess.Popen | None = None
        self.trainer_raised: BaseException | None = None  # what the embedded trainer thread last raised
        self.keeps_standby = config.processes  # a standby serves a role as a process

    def _prepare_state_dir(self: RunningJob, resume: bool, fresh: bool) -> None:
        """Take the state directory's lock first (a live job's directory is refused, untouched),
        then apply the rules of a fresh, resumed or new run; the lock is released if they refuse."""
        self.state_lock = StateDirLock(self.state)
        try:
            Job._apply_state_rules(self, resume, fresh)  # also for the Ray launcher, which shares these rules
        except BaseException:
            self.state_lock.release()
            raise

    def _apply_state_rules(self: RunningJob, resume: bool, fresh: bool) -> None:
        previous = self.state / "job.json"
        replaced = previous.exists() and not resume  # a finished run, or an unfinished one with --fresh
        if previous.exists() and not resume:
            finished = (self.state / "report" / "summary.json").exists()
            if not (fresh or finished):
                raise StateDirInUse(
                    f"{self.state} holds an unfinished run; continue it with --resume, or start over with --fresh")
            clear_state_dir(self.state)
        if (url := self.config.database_url()) is not None:  # a database that outlives the state directory
            from staleflow.servers.db import prepare_for_run

            prepare_for_run(url, resume, discard=fresh or replaced)
        if resume and previous.exists():
            before = JobConfig.model_validate_json(previous.read_text())
            if before.ledger != self.config.ledger:
                raise StateDirInUse(f"{self.state} was created with {before.ledger}; resume needs the same ledger settings")
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "logs").mkdir(exist_ok=True)
        (self.state / "job.json").write_text(self.config.model_dump_json(indent=2))

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, on_started: Callable[[str, str], None] | None = None) -> None:
        # every run gets a fresh token (or the deployment's, from $STALEFLOW_TOKEN_FILE); components,
        # the trainer and child processes read it from the environment, other tools from the
        # owner-only token file named in endpoints.json
        self.token, self.token_file = run_token(self.state)
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
                self.servers[name] = self._serve_thread(name)
            if name == "ts":
                self._release_previous_instances()
            if on_started:
                on_started(name, self.endpoints[name]["url"])
        (self.state / "endpoints.json").write_text(json.dumps(
            {**self.endpoints, "state_dir": str(self.state.resolve()), "trainer": trainer_label(self.config),
             "token_file": str(self.token_file)}, indent=2))
        # the clock of the run starts once everything is up: start-up is not rollout time
        self.started = self.monitor.started = time.monotonic()
        if trainer_in_process(self.config):
            self.trainer_process = self._spawn(TRAINER)
        else:
            self._start_trainer_thread()
        if on_started:
            on_started(TRAINER, trainer_label(self.config))
        self.supervise()

    def _serve_thread(self, name: str) -> RunningServer:
        return serve_in_thread(build_app(name, self.config, self.endpoints), self.config.host,
                               self.endpoints[name]["port"], token=self.token)

    def _start_trainer_thread(self) -> None:
        self.trainer_raised = None
        self.trainer_thread = threading.Thread(target=self._train, name=TRAINER, daemon=True)
        self.trainer_thread.start()

    def _train(self) -> None:
        try:
            run_trainer(self.config, self.endpoints, self.stop, self.started)
        except BaseException as exc:  # surfaced by the job, not lost in a thread
            self.trainer_raised = exc
            if not self.config.supervision.enabled:
                self.stop.set()  # else the supervisor restarts the trainer (or stops a crash loop)

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
        self._register(name, proc)  # now: a start that fails before it is awaited still stops it
        return name, proc, log_path

    def _register(self, name: str, proc: subprocess.Popen) -> None:
        if proc not in self.processes:
            self.processes.append(proc)
        self.procs[name] = proc

    def _await_up(self, name: str, proc: subprocess.Popen, log_path: Path) -> subprocess.Popen:
        self._register(name, proc)
        if name == TRAINER:
            return proc  # no endpoint: the job watches its process and its step log
        limit = 60 if self.config.engine == "sim" else 900  # a vLLM engine on a busy CPU starts slowly
        with ServiceClient(self.endpoints[name]["url"], timeout=2) as probe:
            deadline = time.monotonic() + limit
            while True:  # the child binds, then serves: wait until it answers
                if self.stop.is_set():
                    raise RuntimeError(f"the job stopped while {name} was starting")
                if proc.poll() is not None:
                    raise RuntimeError(f"component {name} exited with {proc.returncode}; see {log_path}")
                try:
                    probe.health()
                    return proc
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"component {name} did not come up in {limit} s; see {log_path}")
                self.stop.wait(0.05)

    # -- one role at a time (the supervisor's and the fault harness's hooks) -------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Send ``sig`` to component ``name``'s process (SIGKILL: a crash; SIGSTOP: a hang)."""
        proc = self.procs[name]
        proc.send_signal(sig)
        return proc

    def pid(self, name: str) -> int | None:
        """The process of component ``name`` (None: a thread of this process)."""
        proc = self.procs.get(name)
        return proc.pid if proc is not None else None

    def log_path(self, name: str) -> Path:
        """Where component ``name`` logs: its own file, or the job's log for a thread of this process."""
        return self.state / "logs" / f"{name}.log" if name in self.procs else self.state / "job.log"

    def components(self) -> list[str]:
        names = [*self.procs, *self.servers]
        return [*names, TRAINER] if self.trainer_thread is not None else names

    def failed(self) -> dict[str, tuple[str, str]]:
        gone = {}
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None and not (name == TRAINER and code == 0):  # 0: it trained every step
                gone[name] = exit_cause(code)
        for name, server in list(self.servers.items()):
            if not server.thread.is_alive():
                gone[name] = ("stopped", "its server thread stopped")
        thread = self.trainer_thread
        if thread is not None and not thread.is_alive() and self.trainer_raised is not None:
            gone[TRAINER] = ("error", f"raised {self.trainer_raised!r}")
        return gone

    def endpoint(self, name: str) -> str | None:
        return None if name == TRAINER else self.endpoints[name]["url"]

    def restart(self, name: str, standby: subprocess.Popen | None = None) -> int | None:
        """Start component ``name`` again at its planned port, after it failed; returns its new
        process id (None for a thread) once it answers its health probe. A process still alive is
        killed; a warm ``standby`` process (see ``staleflow.launch.standby``) takes the role without
        a cold start. A thread is asked to stop and served again (``ComponentStuck`` if it does not
        stop: a thread cannot be killed)."""
        try:
            self.stop_component(name)
        except ComponentStuck:
            self._release(standby)
            raise
        return self.start_component(name, standby)

    def stop_component(self, name: str) -> None:
        """Kill component ``name``'s process, or stop its thread (``ComponentStuck`` if it does not stop)."""
        if name in self.servers:
            server = self.servers[name]
            server.stop(timeout=10)
            if server.thread.is_alive():
                raise self._stuck(name)
            return
        if name == TRAINER and self.trainer_thread is not None:
            if self.trainer_thread.is_alive():
                raise self._stuck(name)
            return
        old = self.procs[name]
        if old.poll() is None:
            old.kill()
        old.wait()
        if old in self.processes:
            self.processes.remove(old)

    def start_component(self, name: str, standby: subprocess.Popen | None = None) -> int | None:
        """Serve component ``name`` the way this job runs it (a thread or a process) at its planned
        port, once it answers; a warm ``standby`` process takes a process's role."""
        if name in self.servers:
            self._release(standby)
            self.servers[name] = self._serve_thread(name)
            return None
        if name == TRAINER and self.trainer_thread is not None:
            self._release(standby)
            self._start_trainer_thread()
            return None
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
        return proc.pid

    def _stuck(self, name: str) -> ComponentStuck:
        return ComponentStuck(
            f"{name} stopped working and, as a thread of the job's own process, cannot be stopped or killed; "
            f"see {self.log_path(name)}. Run with --processes to have a hung component killed and restarted")

    @staticmethod
    def _release(standby: subprocess.Popen | None) -> None:
        """A warm standby handed to a restart that does not need it (a thread's) exits unused."""
        if standby is not None and standby.stdin is not None:
            standby.stdin.close()

    def write_planned_endpoints(self) -> None:
        (self.state / "endpoints.planned.json").write_text(json.dumps(self.endpoints, indent=2))

    def _release_previous_instances(self) -> None:
        """Trajectories routed to instances of a previous run go back to pending."""
        with TrajectoryClient(self.endpoints["ts"]["url"]) as ts:
            for instance_id in instance_ids(self.config):
                with contextlib.suppress(ServiceError):
                    ts.release(instance_id)

    def finished(self) -> bool:
        """The trainer is done: it trained every step, or (unsupervised) it stopped for good."""
        supervised = self.supervisor is not None
        if self.trainer_process is not None:
            code = self.trainer_process.poll()
            return code == 0 if supervised else code is not None
        if self.trainer_thread is None or self.trainer_thread.is_alive():
            return False
        return self.trainer_raised is None or not supervised

    @property
    def trainer_error(self) -> str | None:
        if self.supervisor is not None:
            return None  # a failed trainer is restarted; one that keeps failing is the job's failure
        if self.trainer_raised is not None:
            return repr(self.trainer_raised)
        if self.trainer_process is not None and self.trainer_process.poll() not in (None, 0):
            if not self.stop.is_set():
                return f"the trainer process exited with {self.trainer_process.returncode}; see {self.state / 'logs' / 'trainer.log'}"
        return None

    def steps(self) -> list[StepRecord]:
        return self.step_log.read()

    def shutdown(self, release_state_dir: bool = True) -> None:
        """Stop every component; ``release_state_dir``: give up the state directory's lock too
        (`up` keeps it until its report is written)."""
        self.stop.set()
        if self.supervisor is not None:
            self.supervisor.stop()  # first: nothing stopped below is restarted
        try:
            self._stop_components()
        finally:
            if release_state_dir:
                self.state_lock.release()
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
        for server in reversed(list(self.servers.values())):
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

    def engine_stats(self: RunningJob) -> dict[str, dict]:
        stats = {}
        for name in instance_ids(self.config):
            try:
                with InstanceClient(self.endpoints[name]["url"], timeout=5) as c:
                    stats[name] = c.stats().model_dump()
            except Exception as exc:
                log.debug("no stats from %s: %s", name, exc)
        return stats

    def failover(self: RunningJob) -> dict | None:
        """Progress checkpoints and the trajectories handed back from failed instances, as the
        trajectory server counted them since it (last) started; None while it does not answer."""
        try:
            with TrajectoryClient(self.endpoints["ts"]["url"], timeout=5) as c:
                counts = c.health().progress.model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no trajectory server counts: %s", exc)
            return None
        regenerated = counts.get("regenerated_trajectories", 0)
        return {**counts, "progress_tokens": self.config.instance.progress_tokens,
                "regenerated_tokens_per_trajectory": counts.get("regenerated_tokens", 0) / regenerated if regenerated else None}

    def length_skew(self: RunningJob, after_step: int = -1) -> dict | None:
        """What the staleness bound did to the response lengths, as the trajectory server counted
        it since it (last) started (``staleflow.length_skew``), with the steps after ``after_step``;
        None while it does not answer."""
        try:
            with TrajectoryClient(self.endpoints["ts"]["url"], timeout=10) as c:
                return c.length_skew(after_step=after_step).model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no length skew from the trajectory server: %s", exc)
            return None

    def coordinator_stats(self: RunningJob) -> dict | None:
        """The coordinator's counters, or None while it does not answer."""
        try:
            with CoordinatorClient(self.endpoints["coordinator"]["url"], timeout=5) as c:
                return c.stats().model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no coordinator stats: %s", exc)
            return None

    def command_times(self: RunningJob) -> dict[str, float]:
        """Seconds spent in commands by kind (issued to answered, every command of the run), their
        counts (``{kind}_count``) and the mean planning time of a cycle."""
        stats = self.coordinator_stats()
        if stats is None:
            return {}
        totals: dict[str, float] = dict(stats.get("command_seconds", {}))
        totals.update({f"{kind}_count": n for kind, n in stats.get("command_count", {}).items()})
        totals["mean_decision_ms"] = stats["mean_decision_ms"]
        return totals


def job_summary(job: SummarizedJob, config: JobConfig, restarts: list[dict], failure: str | None) -> dict:
    """A finished or stopped job's ``summary.json``: the steps, samples, engine and command
    timings (``staleflow.report.summarize``), its restarts, failover, length skew and failure."""
    from staleflow.report import summarize

    wall = time.monotonic() - job.started
    summary = summarize(config, job.steps(), job.monitor.samples, job.engine_stats(), job.command_times(), wall,
                        trainer_label(config))
    summary["restarts"] = restarts
    summary["failover"] = job.failover()
    summary["length_skew"] = job.length_skew()
    if failure:
        summary["failure"] = failure
    return summary


def write_job_report(config: JobConfig, summary: dict, samples: list, completed: bool) -> list[Path]:
    """The report of a completed job in ``report/``; of a stopped one in ``report-partial/``."""
    from staleflow.report import write_report

    return write_report(config.state_dir / ("report" if completed else "report-partial"), summary, samples)


SKEW_WAIT_S = 5.0
"""How long a step's tracking waits for the trajectory server to count its batch."""


class JobTracking:
    """Sends each training step of a job, once, to the configured logger backends
    (``staleflow.tracking``): the step record, the instances' load at the time, and the
    coordinator's planning and command times since the previous step."""

    def __init__(self, job: TrackedJob, console: Callable[[str], None]):
        from staleflow.tracking import Tracker

        settings = job.config.logger
        self.job = job
        self.directory = settings.directory or job.state / "tracking"
        self.tracker = Tracker.open(settings.backends, self.directory, project=settings.project,
                                    run_name=settings.run_name or job.state.resolve().name,
                                    config=job.config.model_dump(mode="json"),
                                    mlflow_tracking_uri=settings.mlflow_tracking_uri, console=console)
        self.logged = -1  # the newest version sent
        self.control_before: dict | None = None
        self._seen: dict[int, float] = {}  # step -> when it was first ready to send

    def update(self, steps: list[StepRecord], sample: Sample | None, final: bool = False) -> None:
        """Send the steps not sent yet. A step whose batch the trajectory server has not yet
        counted in its length-skew accounting waits for it (``SKEW_WAIT_S`` at most) unless
        ``final``."""
        from staleflow.tracking import step_metrics

        new = [s for s in steps if s.version > self.logged]
        if not new:
            return
        skew = self.job.length_skew(after_step=self.logged) or {}
        windows = {w["step"]: w for w in skew.get("per_step", [])}
        if not final and skew:
            counted = [s for s in new if windows.get(s.version, {}).get("trained")]
            first_seen = self._seen.setdefault(new[0].version, time.monotonic())
            if len(counted) < len(new) and time.monotonic() - first_seen < SKEW_WAIT_S:
                new = new[: next(i for i, s in enumerate(new) if s not in counted)]
                if not new:
                    return
        control = self.job.coordinator_stats()
        tokens = {s.version: s.response_tokens for s in steps}
        by_version = {s.version: s for s in steps}
        instances = sample.instances if sample else None
        for record in new:
            last = record is new[-1]  # the live views belong to the newest step
            previous = by_version.get(record.version - 1)
            cumulative = sum(n for v, n in tokens.items() if v <= record.version)
            scalars, histograms = step_metrics(
                asdict(record), asdict(previous) if previous else None, instances if last else None,
                control if last else None, self.control_before, cumulative_tokens=cumulative,
                time_scale=self.job.config.speed if self.job.config.engine == "sim" else 1.0,
                length_skew=windows.get(record.version))
            self.tracker.log(record.version, scalars, histograms)
            self.logged = record.version
        if control is not None:
            self.control_before = control

    def close(self) -> None:
        self.tracker.close()

