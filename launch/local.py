"""`staleflow up`: a whole StaleFlow job on one machine.

The components (staleness manager, parameter server, reward server, trajectory server, rollout
instances, coordinator) are built from one ``JobConfig`` and one endpoints map
(``staleflow.launch.plan``), so the same configuration runs them embedded (threads of this process)
or as processes of their own (``staleflow serve component NAME --job FILE``). A trainer consumes
Ready buffers; with the ``sim`` engine it is a simulated trainer with a step-time model, clearly
labelled as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from staleflow.api.base import ServiceClient, ServiceError
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import JobConfig
from staleflow.launch.launcher import ComponentStuck, exit_cause
from staleflow.launch.plan import (
    STARTED_ENV,
    TRAINER,
    build_app,
    component_names,
    instance_ids,
    plan_endpoints,
    run_trainer,
    step_log,
    trainer_label,
)
from staleflow.launch.state_lock import take_state_dir
from staleflow.launch.supervisor import Supervised
from staleflow.launch.views import JobViews, Monitor
from staleflow.servers.auth import TOKEN_ENV, run_token
from staleflow.servers.http import RunningServer, serve_in_thread
from staleflow.training.role import StepRecord


def in_own_process(name: str, config: JobConfig) -> bool:
    """vLLM instances always get a process each: one engine per process."""
    return config.processes or (config.engine != "sim" and name.startswith("inst-"))


def trainer_in_process(config: JobConfig) -> bool:
    """The real trainer always runs as processes of its own (torch.distributed ranks)."""
    return config.processes or config.engine != "sim"


class LocalJob(Supervised, JobViews):
    """A job on this machine: each component a thread of this process (embedded) or a process of
    its own (``--processes``; always a vLLM instance and the FSDP trainer). It implements
    ``staleflow.launch.launcher.Launcher``, for the supervisor; its read views are ``JobViews``."""

    check_interval_s = 0.1  # process exits and stopped threads are looked for this often
    parallel_restarts = False  # one at a time: a restart takes the warm standby

    def __init__(self, config: JobConfig, resume: bool = False, fresh: bool = False):
        self.config = config
        self.state = config.state_dir
        self.state_lock = take_state_dir(config, resume, fresh)
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
