"""What a launcher's job shows while it runs and when it ends, read from its components over HTTP
wherever they run: the instances' load over time (``Monitor``), each engine's stats, the
coordinator's counters and command times, the trajectory server's failover and length-skew counts
(``JobViews``, which both launchers' jobs inherit), the summary and report (``job_summary``,
``write_job_report``) and the per-step tracking (``JobTracking``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.instance import InstanceClient
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import JobConfig
from staleflow.launch.plan import instance_ids, trainer_label
from staleflow.training.role import StepRecord

log = logging.getLogger(__name__)


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


class JobViews:
    """The read views of a running job, over its endpoints map: what ``staleflow up`` shows while
    the job runs and sums up at its end. Each answers None (or nothing) while the component it
    reads does not answer."""

    config: JobConfig
    endpoints: dict[str, dict]

    def engine_stats(self) -> dict[str, dict]:
        stats = {}
        for name in instance_ids(self.config):
            try:
                with InstanceClient(self.endpoints[name]["url"], timeout=5) as c:
                    stats[name] = c.stats().model_dump()
            except Exception as exc:
                log.debug("no stats from %s: %s", name, exc)
        return stats

    def failover(self) -> dict | None:
        """Progress checkpoints and the trajectories handed back from failed instances, as the
        trajectory server counted them since it (last) started."""
        try:
            with TrajectoryClient(self.endpoints["ts"]["url"], timeout=5) as c:
                counts = c.health().progress.model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no trajectory server counts: %s", exc)
            return None
        regenerated = counts.get("regenerated_trajectories", 0)
        return {**counts, "progress_tokens": self.config.instance.progress_tokens,
                "regenerated_tokens_per_trajectory": counts.get("regenerated_tokens", 0) / regenerated if regenerated else None}

    def length_skew(self, after_step: int = -1) -> dict | None:
        """What the staleness bound did to the response lengths, as the trajectory server counted
        it since it (last) started (``staleflow.length_skew``), with the steps after ``after_step``."""
        try:
            with TrajectoryClient(self.endpoints["ts"]["url"], timeout=10) as c:
                return c.length_skew(after_step=after_step).model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no length skew from the trajectory server: %s", exc)
            return None

    def coordinator_stats(self) -> dict | None:
        """The coordinator's counters."""
        try:
            with CoordinatorClient(self.endpoints["coordinator"]["url"], timeout=5) as c:
                return c.stats().model_dump()
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.debug("no coordinator stats: %s", exc)
            return None

    def command_times(self) -> dict[str, float]:
        """Seconds spent in commands by kind (issued to answered, every command of the run), their
        counts (``{kind}_count``) and the mean planning time of a cycle."""
        stats = self.coordinator_stats()
        if stats is None:
            return {}
        totals: dict[str, float] = dict(stats.get("command_seconds", {}))
        totals.update({f"{kind}_count": n for kind, n in stats.get("command_count", {}).items()})
        totals["mean_decision_ms"] = stats["mean_decision_ms"]
        return totals


class SummarizedJob(Protocol):
    """What ``job_summary`` reads of a launcher's job, local or on Ray."""

    started: float
    monitor: Monitor

    def steps(self) -> list[StepRecord]: ...
    def engine_stats(self) -> dict[str, dict]: ...
    def command_times(self) -> dict[str, float]: ...
    def failover(self) -> dict | None: ...
    def length_skew(self, after_step: int = -1) -> dict | None: ...


class TrackedJob(Protocol):
    """What ``JobTracking`` reads of a launcher's job, local or on Ray."""

    config: JobConfig
    state: Path

    def coordinator_stats(self) -> dict | None: ...
    def length_skew(self, after_step: int = -1) -> dict | None: ...


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
