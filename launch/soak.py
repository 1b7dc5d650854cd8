"""A soak run: one long job, measured near its start and near its end, to show that nothing grows
with the run's history.

``Soak`` runs a job (small batches, a fast simulated clock) and, once a few steps in and again a few
steps before its last, measures the same things side by side:

* the coordinator's cost per cycle (wall time of its cycles over a window, from its own counters),
  and the time the trajectory server takes to answer the polls the coordinator makes every cycle
  (``/v1/pending`` and ``/v1/routed``);
* the trajectory server's live store (trajectories in memory and in the live table) and its archive;
* the trajectory server's restart time: it is SIGKILLed, and the time from the kill to the
  supervisor's restart (which waits for its health probe: the store is reloaded by then) is taken.

Along the run it samples the live and archived sizes and the ledger's event log every few steps,
and, on a thread of its own, at each step and at least every second between the two checkpoints,
the resident memory (``VmRSS``) of each component's process and the trainer's: ``memory_growth``
compares the first quarter of that span with the last.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import func, select

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import JobConfig
from staleflow.host import status_kib
from staleflow.launch.local import LocalJob
from staleflow.launch.plan import TRAINER, component_names
from staleflow.servers import db
from staleflow.servers.schema import ledger_events, ts_trajectories, ts_trajectories_archive


@dataclass
class Checkpoint:
    """The measurements taken at one point of the run."""

    step: int
    cycle_ms: float  # mean wall time of a coordinator cycle over the window
    cycles_per_s: float
    poll_ms: float  # median time of the coordinator's two polls of the trajectory server, together
    live_trajectories: int  # in the trajectory server's memory (and its live table)
    archived_trajectories: int
    ledger_events: int
    ts_restart_s: float | None  # median of SIGKILL -> restarted and answering its health probe
    ts_restarts_s: list[float | None] = field(default_factory=list)  # each of them
    phase_ms: dict[str, float] = field(default_factory=dict)  # mean per cycle of each step of the cycle
    # CPU time, which the machine's load does not inflate as it does wall time: the coordinator's
    # process per cycle, and every component's process per training step, over the window
    coordinator_cpu_ms: float | None = None
    cpu_ms_per_step: dict[str, float] = field(default_factory=dict)


@dataclass
class StoreSample:
    step: int
    t: float
    live_trajectories: int
    live_rows: int
    archived_trajectories: int
    ledger_events: int
    trajectories_db_bytes: int  # SQLite's files (with the WAL); 0 on a shared database server
    ledger_db_bytes: int = 0


@dataclass
class MemorySample:
    step: int
    t: float
    rss: dict[str, int]  # resident bytes of each component's process, by component
    pids: dict[str, int]


@dataclass
class MemoryGrowth:
    """One process's resident memory: the median of its samples in the first and in the last
    quarter of the measured span (medians: a collection or a burst of one sample does not decide)."""

    component: str
    first_bytes: int
    last_bytes: int
    samples: int

    @property
    def growth(self) -> float:
        return self.last_bytes / self.first_bytes - 1 if self.first_bytes else 0.0


def memory_growth(samples: list[MemorySample]) -> dict[str, MemoryGrowth]:
    """Per component, from the samples of its newest process (one restarted within the span is
    judged from its restart on; one with no sample of its newest process in the first quarter is
    left out). Quarters are of the span's steps, so a pause does not weigh in."""
    if len(samples) < 2:
        return {}
    first_step, last_step = samples[0].step, samples[-1].step
    quarter = (last_step - first_step) / 4
    out = {}
    for name in samples[-1].pids:
        pid = samples[-1].pids[name]
        own = [s for s in samples if s.pids.get(name) == pid and name in s.rss]
        early = [s.rss[name] for s in own if s.step <= first_step + quarter]
        late = [s.rss[name] for s in own if s.step >= last_step - quarter]
        if early and late and quarter > 0:
            out[name] = MemoryGrowth(name, int(statistics.median(early)), int(statistics.median(late)), len(own))
    return out


@dataclass
class SoakResult:
    steps_planned: int
    steps_done: int
    finished: bool
    wall_s: float
    start: Checkpoint | None = None
    end: Checkpoint | None = None
    samples: list[StoreSample] = field(default_factory=list)
    failure: str | None = None
    stopped_early: bool = False  # the time box ran out: the end was measured there
    memory: list[MemorySample] = field(default_factory=list)

    def memory_growth(self) -> dict[str, MemoryGrowth]:
        return memory_growth(self.memory)

    def ratios(self) -> dict[str, float | None]:
        """End over start, for each cost that must not grow with the run."""
        if self.start is None or self.end is None:
            return {}

        def ratio(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None or a <= 0 else b / a

        return {"cycle_ms": ratio(self.start.cycle_ms, self.end.cycle_ms),
                "coordinator_cpu_ms": ratio(self.start.coordinator_cpu_ms, self.end.coordinator_cpu_ms),
                "job_cpu_ms_per_step": ratio(sum(self.start.cpu_ms_per_step.values()) or None,
                                             sum(self.end.cpu_ms_per_step.values()) or None),
                "poll_ms": ratio(self.start.poll_ms, self.end.poll_ms),
                "ts_restart_s": ratio(self.start.ts_restart_s, self.end.ts_restart_s),
                "live_trajectories": ratio(self.start.live_trajectories, self.end.live_trajectories)}

    def to_json(self) -> dict:
        live = [s.live_trajectories for s in self.samples]
        return {"steps_planned": self.steps_planned, "steps_done": self.steps_done, "finished": self.finished,
                "stopped_early": self.stopped_early, "wall_s": self.wall_s, "failure": self.failure,
                "start": asdict(self.start) if self.start else None, "end": asdict(self.end) if self.end else None,
                "ratios": self.ratios(), "live_trajectories_max": max(live, default=0),
                "archived_trajectories_last": self.samples[-1].archived_trajectories if self.samples else 0,
                "samples": [asdict(s) for s in self.samples],
                "memory_growth": {name: {**asdict(g), "growth": g.growth} for name, g in self.memory_growth().items()},
                "memory": [asdict(s) for s in self.memory]}


class MemorySampler:
    """The resident memory of each component's process and the trainer's (those that are threads of
    the soak's process, or gone, are left out), sampled on a thread of its own from the start
    checkpoint to the end one: at each step the job reaches, and at least once a second. The soak's
    own loop cannot do it: a checkpoint restarts the trajectory server and measures for seconds
    while the job goes on, so a fast job would pass most of the span unsampled."""

    POLL_S = 0.1
    EVERY_S = 1.0

    def __init__(self, job: LocalJob, manager_url: str, started: float):
        self.job, self.started = job, started
        self.samples: list[MemorySample] = []
        self._manager = ManagerClient(manager_url, timeout=5.0)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)
        self._thread.start()

    def stop(self) -> list[MemorySample]:
        self._done.set()
        self._thread.join()
        self._manager.close()
        return self.samples

    def _run(self) -> None:
        last_step, last_at = None, 0.0
        while not self._done.wait(self.POLL_S):
            step = Soak._train_version(self._manager)
            now = time.monotonic()
            if step is not None and (step != last_step or now - last_at >= self.EVERY_S):
                self.samples.append(self._sample(step, now))
                last_step, last_at = step, now

    def _sample(self, step: int, now: float) -> MemorySample:
        pids = {name: self.job.pid(name) for name in component_names(self.job.config)}
        if self.job.trainer_process is not None:
            pids[TRAINER] = self.job.trainer_process.pid
        live = {name: pid for name, pid in pids.items() if pid}
        rss = {name: kib * 1024 for name, pid in live.items() if (kib := status_kib("VmRSS", pid)) is not None}
        return MemorySample(step, now - self.started, rss, {name: live[name] for name in rss})


class Soak:
    def __init__(self, config: JobConfig, warmup_steps: int = 20, end_margin_steps: int = 20,
                 sample_every_steps: int = 50, window_s: float = 10.0, deadline_s: float = 86_400.0,
                 stop_after_s: float | None = None, restarts: int = 3):
        if config.steps < warmup_steps + end_margin_steps + 1:
            raise ValueError(f"a soak needs more than {warmup_steps + end_margin_steps} steps (warm-up and end "
                             f"margin), got {config.steps}; raise --steps")
        if not config.supervision.enabled:
            raise ValueError("the soak measures restarts by the job's supervisor: enable supervision")
        self.config = config.model_copy(update={"processes": True})
        self.warmup_steps = warmup_steps
        self.end_margin_steps = end_margin_steps
        self.sample_every_steps = sample_every_steps
        self.window_s = window_s
        self.deadline_s = deadline_s
        self.stop_after_s = stop_after_s  # measure the end then, and stop the job there (a time-boxed soak)
        self.restarts = restarts

    def run(self, progress=None) -> SoakResult:
        say = progress or (lambda msg: None)
        job = LocalJob(self.config, fresh=True)
        job.write_planned_endpoints()
        try:
            job.start()
            return self._drive(job, say)
        finally:
            job.shutdown()

    # -- the run ---------------------------------------------------------------------------

    def _drive(self, job: LocalJob, say) -> SoakResult:
        urls = {k: v["url"] for k, v in job.endpoints.items()}
        ts_url, ledger_url = self._database_urls()
        ts_db, ledger_db = db.make_engine(ts_url), db.make_engine(ledger_url)
        manager, coordinator = ManagerClient(urls["manager"], timeout=5.0), CoordinatorClient(urls["coordinator"], timeout=5.0)
        result = SoakResult(self.config.steps, 0, False, 0.0)
        started = time.monotonic()
        deadline = started + self.deadline_s
        next_sample = 0
        recent: deque[tuple[float, int]] = deque()  # (time, step) over the last minute: the run's pace
        sampler: MemorySampler | None = None
        try:
            while time.monotonic() < deadline and not job.finished():
                if job.failure:
                    result.failure = job.failure
                    break
                step = self._train_version(manager)
                if step is None:
                    job.stop.wait(0.5)
                    continue
                now = time.monotonic()
                recent.append((now, step))
                while now - recent[0][0] > 60:
                    recent.popleft()
                end_at = self.config.steps - self._end_margin(recent)
                if step >= next_sample:
                    result.samples.append(self._sample(step, started, urls["ts"], ts_db, ledger_db))
                    next_sample = step + self.sample_every_steps
                    say(f"step {step}: {result.samples[-1].live_trajectories} live, "
                        f"{result.samples[-1].archived_trajectories} archived trajectories")
                if result.start is None and step >= self.warmup_steps:
                    result.start = self._checkpoint(job, step, urls["ts"], manager, coordinator, ts_db, ledger_db)
                    say(f"start: {result.start}")
                    sampler = MemorySampler(job, urls["manager"], started)
                elif result.start is not None and result.end is None and (step >= end_at or self._time_up(started)):
                    if sampler is not None:
                        result.memory = sampler.stop()
                    result.end = self._checkpoint(job, step, urls["ts"], manager, coordinator, ts_db, ledger_db)
                    say(f"end: {result.end}")
                    if step < end_at:
                        result.stopped_early = True
                        break
                job.stop.wait(1.0)  # sampling pacing
            result.finished = job.finished()
            result.steps_done = len(job.steps())
            result.wall_s = time.monotonic() - started
            if not result.finished and result.failure is None and not result.stopped_early:
                result.failure = f"the job did not finish in {self.deadline_s:.0f}s ({result.steps_done} steps)"
            return result
        finally:
            if sampler is not None:
                sampler.stop()
            manager.close()
            coordinator.close()
            ts_db.dispose()
            ledger_db.dispose()

    def _end_margin(self, recent: deque[tuple[float, int]]) -> int:
        """Steps to leave for the end checkpoint: at least ``end_margin_steps``, and more on a fast run,
        whose window (three, for the slack of the loop and a stretched window) must fit before the
        job's last step, or the end would be measured on a job winding down."""
        (t0, s0), (t1, s1) = recent[0], recent[-1]
        pace = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
        return max(self.end_margin_steps, math.ceil(3 * self.window_s * pace))

    def _time_up(self, started: float) -> bool:
        return self.stop_after_s is not None and time.monotonic() - started >= self.stop_after_s

    def _database_urls(self) -> tuple[str, str]:
        shared = self.config.database_url()
        state = self.config.state_dir.resolve()
        return shared or db.sqlite_url(state / "trajectories.db"), shared or db.sqlite_url(state / "ledger.db")

    @staticmethod
    def _train_version(manager: ManagerClient) -> int | None:
        try:
            return manager.buffers().train_version
        except (httpx.HTTPError, ServiceError, ValueError):
            return None

    def _sample(self, step: int, started: float, ts_url: str, ts_db, ledger_db) -> StoreSample:
        live = self._live_trajectories(ts_url)
        with ts_db.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(ts_trajectories)).scalar_one()
            archived = conn.execute(select(func.count()).select_from(ts_trajectories_archive)).scalar_one()
        with ledger_db.connect() as conn:
            events = conn.execute(select(func.count()).select_from(ledger_events)).scalar_one()
        return StoreSample(step, time.monotonic() - started, live if live is not None else -1, rows, archived, events,
                           self._db_bytes("trajectories.db"), self._db_bytes("ledger.db"))

    def _db_bytes(self, name: str) -> int:
        path = self.config.state_dir / name
        return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) if path.exists() else 0

    @staticmethod
    def _live_trajectories(ts_url: str) -> int | None:
        try:
            with TrajectoryClient(ts_url, timeout=10.0) as ts:
                return sum(ts.health().counts.values())
        except (httpx.HTTPError, ServiceError, ValueError):
            return None

    def _checkpoint(self, job: LocalJob, step: int, ts_url: str, manager: ManagerClient, coordinator: CoordinatorClient,
                    ts_db, ledger_db) -> Checkpoint:
        cpu_before, version_before = self._cpu_seconds(job), self._train_version(manager)
        before, t0 = coordinator.stats(), time.monotonic()
        job.stop.wait(self.window_s)
        # the CPU per training step needs a step inside the window: a slow machine may take longer
        # than the window for one, so it is stretched (by at most 10 windows) until one is trained
        stretch_until = t0 + 10 * self.window_s
        while (self._train_version(manager) or 0) <= (version_before or 0) and time.monotonic() < stretch_until \
                and not job.stop.wait(min(0.2, self.window_s)):
            pass
        after, t1 = coordinator.stats(), time.monotonic()
        cpu_after, version_after = self._cpu_seconds(job), self._train_version(manager)
        cycles = after.cycles - before.cycles
        cycle_ms = (after.cycle_ms_total - before.cycle_ms_total) / cycles if cycles else float("nan")
        phase_ms = {phase: (ms - before.phase_ms_total.get(phase, 0.0)) / cycles
                    for phase, ms in after.phase_ms_total.items()} if cycles else {}
        cpu_ms = {name: (cpu_after[name] - cpu_before[name]) * 1e3 for name in cpu_after.keys() & cpu_before.keys()
                  if cpu_after[name] >= cpu_before[name]}  # a process restarted meanwhile is left out
        steps = (version_after or 0) - (version_before or 0)
        coordinator_cpu_ms = cpu_ms["coordinator"] / cycles if "coordinator" in cpu_ms and cycles else None
        cpu_ms_per_step = {name: ms / steps for name, ms in sorted(cpu_ms.items())} if steps > 0 else {}
        poll_ms = self._poll_ms(ts_url)
        sample = self._sample(step, 0.0, ts_url, ts_db, ledger_db)
        restarts = [self._restart_ts(job) for _ in range(self.restarts)]
        measured = [r for r in restarts if r is not None]
        return Checkpoint(step, cycle_ms, cycles / (t1 - t0), poll_ms, sample.live_trajectories,
                          sample.archived_trajectories, sample.ledger_events,
                          statistics.median(measured) if measured else None, restarts, phase_ms,
                          coordinator_cpu_ms, cpu_ms_per_step)

    @staticmethod
    def _cpu_seconds(job: LocalJob) -> dict[str, float]:
        """User + system CPU seconds of each component's process so far (Linux ``/proc``; empty
        elsewhere, and a component that is a thread of this process is left out)."""
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        seconds = {}
        for name in component_names(job.config):
            pid = job.pid(name)
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() if pid else None
            except OSError:
                continue
            if fields:
                seconds[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return seconds

    @staticmethod
    def _poll_ms(ts_url: str, rounds: int = 20) -> float:
        times = []
        with TrajectoryClient(ts_url, timeout=30.0) as ts:
            for _ in range(rounds):
                t = time.perf_counter()
                ts.pending()
                ts.routed()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    @staticmethod
    def _restart_ts(job: LocalJob, timeout_s: float = 300.0) -> float | None:
        """SIGKILL the trajectory server; seconds until the supervisor has it back (answering)."""
        supervisor = job.supervisor
        assert supervisor is not None
        give_up = time.monotonic() + timeout_s
        while not supervisor.ready and time.monotonic() < give_up:
            job.stop.wait(0.2)  # a warm standby is being prepared: restarts are measured with one
        restarted: list[float] = []
        supervisor.on_restarted.append(lambda name, t: restarted.append(t) if name == "ts" else None)
        try:
            killed_at = time.monotonic()
            job.kill("ts", signal.SIGKILL)
            while not restarted and time.monotonic() < give_up and not job.failure:
                job.stop.wait(0.05)  # the supervisor's hook fires from its own thread
            return restarted[0] - killed_at if restarted else None
        finally:
            supervisor.on_restarted.pop()


def write_report(path: Path, report: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def plot(report: dict, path: Path) -> Path | None:
    """Live and archived trajectories over the run (None: matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = report["samples"]
    steps = [s["step"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [s["live_trajectories"] for s in samples], label="live trajectories (memory)")
    ax.plot(steps, [s["archived_trajectories"] for s in samples], label="archived trajectories")
    ax.plot(steps, [s["ledger_events"] for s in samples], label="ledger events")
    ax.set_xlabel("training step")
    ax.set_yscale("symlog")
    ax.legend()
    ax.set_title("soak: the working set stays bounded")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
