"""Fault injection for a running job: kill one role at a time, measure, verify.

The job repairs itself: every job runs a ``Supervisor`` (``staleflow.launch.supervisor``) that
restarts only the role that failed, at the same port. This harness only injects the faults and
measures what the supervisor does.

``FaultRun`` runs a job, injects faults every few training steps (SIGKILL; SIGSTOP for a hung
instance), measures per fault the detection time, the recovery time and the rollout throughput
kept during the outage, and after the run verifies the invariants: no trajectory lost or
consumed twice, every consumed trajectory within the staleness bound, the trainer's version never
going backwards, the parameter server serving a complete newest version.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.instance import InstanceClient
from staleflow.api.manager import ManagerClient
from staleflow.api.params import ParamsApiClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import JobConfig
from staleflow.launch.local import LocalJob
from staleflow.launch.plan import instance_ids

log = logging.getLogger(__name__)

ROLES = ("instance", "ts", "params", "manager", "coordinator", "trainer")
INSTANCE_BUSY_WAIT_S = 5.0  # an instance fault waits this long at most for the instance to hold running work
SERVICE_OF_ROLE = {"ts": "ts", "params": "params", "manager": "manager", "coordinator": "coordinator",
                   "reward": "reward"}


@dataclass
class Fault:
    role: str
    name: str  # the component killed
    how: str  # "kill" (SIGKILL) or "hang" (SIGSTOP)
    at: float  # seconds since the run started
    step: int  # the train version when it was injected
    detected_at: float | None = None
    detected_by: str = ""
    restarted_at: float | None = None
    recovered_at: float | None = None
    tokens_per_s_before: float = 0.0
    tokens_per_s_during: float = 0.0
    steps_during: int = 0
    # instance faults: per trajectory running there, the response tokens it held when the fault
    # hit that the trajectory server did not hold (everything since its last checkpoint), which
    # the instance it resumes on generates again
    regenerated_tokens: list[int] = field(default_factory=list)
    checkpoint_round_s: float | None = None  # the failed instance's mean time to take and send a checkpoint batch
    decode_steps_per_s: float | None = None  # the failed instance's decode steps per wall second before the fault
    since_checkpoint_round_s: float | None = None  # from the failed instance's last look for checkpoints to the fault

    @property
    def detection_s(self) -> float | None:
        return None if self.detected_at is None else self.detected_at - self.at

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at

    @property
    def throughput_kept(self) -> float | None:
        return self.tokens_per_s_during / self.tokens_per_s_before if self.tokens_per_s_before else None

    def to_json(self) -> dict:
        return {**asdict(self), "detection_s": self.detection_s, "recovery_s": self.recovery_s,
                "throughput_kept": self.throughput_kept}


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Probes:
    """The clients the harness watches the job through while faults are injected."""

    manager: ManagerClient
    coordinator: CoordinatorClient
    params: ParamsApiClient


class TokenMeter:
    """Rollout tokens generated so far over all instances, sampled from their /v1/stats; a
    restarted instance's counter starts again at zero, so its previous total is carried."""

    def __init__(self, job: LocalJob):
        self.urls = {i: job.endpoints[i]["url"] for i in instance_ids(job.config)}
        self.last: dict[str, int] = {}
        self.carried: dict[str, int] = {}
        self.samples: list[tuple[float, int, int]] = []  # (t, tokens, train_version)

    def sample(self, clients: dict[str, InstanceClient], train_version: int) -> None:
        for name, client in clients.items():
            try:
                value = int((client.stats().model_extra or {}).get("tokens_generated", 0))
            except (httpx.HTTPError, ServiceError, ValueError):
                continue
            if value < self.last.get(name, 0):
                self.carried[name] = self.carried.get(name, 0) + self.last[name]
            self.last[name] = value
        total = sum(self.last.values()) + sum(self.carried.values())
        self.samples.append((time.monotonic(), total, train_version))

    def rate(self, start: float, end: float) -> float:
        inside = [(t, n) for t, n, _ in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def steps(self, start: float, end: float) -> int:
        inside = [v for t, _, v in self.samples if start <= t <= end]
        return (max(inside) - min(inside)) if inside else 0


@dataclass
class FaultRunResult:
    wall_s: float  # the training phase: components up -> last step
    steps: int
    faults: list[Fault] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    checks: dict[str, object] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # when each step finished, s since the start
    failover: dict | None = None  # the trajectory server's checkpoint and failover counts (``JobViews.failover``)
    length_skew: dict | None = None  # what the bound did to the response lengths (``JobViews.length_skew``)
    cycle_s: float | None = None  # the coordinator's mean time from one cycle's start to the next

    @property
    def pace_s(self) -> float:
        """The median step interval away from faults: from each fault to its recovery plus one
        step is the outage's; the rest is the run's own fault-free pace."""
        times = [0.0, *self.step_times]
        spans = [(f.at, (f.recovered_at or f.at)) for f in self.faults]
        clean = []
        for a, b in zip(times, times[1:], strict=False):
            if not any(a <= end and b >= start for start, end in spans):
                clean.append(b - a)
        return float(np.median(clean)) if clean else 0.0

    def to_json(self) -> dict:
        return {"wall_s": self.wall_s, "steps": self.steps, "faults": [f.to_json() for f in self.faults],
                "violations": self.violations, "checks": self.checks, "restarts": self.restarts,
                "events": self.events, "step_times": self.step_times, "pace_s": self.pace_s,
                "failover": self.failover, "length_skew": self.length_skew, "cycle_s": self.cycle_s}


class FaultRun:
    """One job with faults injected every ``every`` training steps, cycling through ``roles``."""

    def __init__(self, config: JobConfig, roles: list[str], every: int = 3, hang_instance: bool = False,
                 deadline_s: float = 300.0, settle_steps: int = 1):
        unknown = [r for r in roles if r not in ROLES and r != "reward"]
        if unknown:
            raise ValueError(f"unknown roles {unknown}; roles are {', '.join(ROLES)}")
        self.config = config.model_copy(update={"processes": True})
        self.roles = roles
        self.every = every
        self.hang_instance = hang_instance
        self.deadline_s = deadline_s
        self.settle_steps = settle_steps
        self.faults: list[Fault] = []
        self._instance_turn = 0

    # -- the run --------------------------------------------------------------------------

    def run(self, progress=None) -> FaultRunResult:
        job = LocalJob(self.config, fresh=True)
        job.write_planned_endpoints()
        try:
            job.start()
            return self._drive(job, progress or (lambda msg: None))
        finally:
            job.shutdown()

    def _drive(self, job: LocalJob, progress) -> FaultRunResult:
        meter = TokenMeter(job)
        supervisor = job.supervisor
        if supervisor is None:
            raise ValueError("the fault harness measures the job's supervisor: enable supervision in the job config")
        supervisor.on_detected.append(self._detected)
        supervisor.on_restarted.append(self._restarted)
        urls = {k: v["url"] for k, v in job.endpoints.items()}
        stats_clients = {i: InstanceClient(u, timeout=1.0) for i, u in meter.urls.items()}
        probe = Probes(ManagerClient(urls["manager"], timeout=1.0), CoordinatorClient(urls["coordinator"], timeout=1.0),
                       ParamsApiClient(urls["params"], timeout=1.0))
        versions: list[int] = []
        ps_versions: list[int] = []
        started = job.started
        deadline = started + self.deadline_s
        next_fault_at = self.every
        queue = list(self.roles)
        try:
            while not self._done(job) and time.monotonic() < deadline:
                tv = self._train_version(probe.manager, versions)
                ps = self._ps_version(probe.params)
                if ps is not None:
                    ps_versions.append(ps)
                meter.sample(stats_clients, versions[-1] if versions else 0)
                current = self.faults[-1] if self.faults else None
                if current is not None and current.recovered_at is None:
                    if self._recovered(current, job, probe):
                        current.recovered_at = time.monotonic() - started
                        next_fault_at = max(next_fault_at, (tv or 0) + self.settle_steps)
                        progress(f"{current.role} recovered in {current.recovery_s:.2f}s")
                elif queue and tv is not None and tv >= next_fault_at and supervisor.ready:
                    role = queue.pop(0)
                    self._inject(job, role, tv, started)
                    progress(f"step {tv}: {self.faults[-1].how} {self.faults[-1].name}")
                    next_fault_at = tv + self.every
                if supervisor.failure:
                    raise RuntimeError(f"the supervisor stopped the job: {supervisor.failure}")
                job.stop.wait(0.1)  # sampling pacing
            finished = self._done(job)
            steps = job.steps()
            wall = steps[-1].finished_at if steps else time.monotonic() - started
            result = FaultRunResult(wall_s=wall, steps=len(steps), faults=self.faults,
                               step_times=[st.finished_at for st in steps],
                               restarts=dict(supervisor.counts),
                               events=[{**e, "t": e["t"] - started} for e in supervisor.events])
            supervisor.stop()
            if not finished:
                result.violations.append(f"the job did not finish in {self.deadline_s:.0f}s "
                                         f"({len(steps)} of {self.config.steps} steps)")
            for fault in self.faults:
                end = started + fault.recovered_at if fault.recovered_at is not None else time.monotonic()
                start_abs = started + fault.at
                window = max(end - start_abs, 3.0)
                fault.tokens_per_s_before = meter.rate(start_abs - max(window, 10.0), start_abs)
                fault.tokens_per_s_during = meter.rate(start_abs, start_abs + window)
                fault.steps_during = meter.steps(start_abs, end)
            self._verify(job, versions, ps_versions, result)
            result.failover, result.length_skew = job.failover(), job.length_skew()
            result.cycle_s = self._cycle_seconds(probe.coordinator)
            return result
        finally:
            supervisor.stop()
            for c in [*stats_clients.values(), probe.manager, probe.coordinator, probe.params]:
                c.close()

    @staticmethod
    def _done(job: LocalJob) -> bool:
        """The trainer process exited by itself, having trained every step (a killed one is not done)."""
        return job.finished() and job.trainer_process is not None and job.trainer_process.returncode == 0

    def _inject(self, job: LocalJob, role: str, tv: int, started: float) -> None:
        how = "kill"
        if role == "instance":
            names = instance_ids(self.config)
            name = names[self._instance_turn % len(names)]
            self._instance_turn += 1
            if self.hang_instance and self._instance_turn % 2 == 0:
                how = "hang"
        elif role == "trainer":
            name = "trainer"
        else:
            name = SERVICE_OF_ROLE[role]
        decode_rate = self._decode_rate(job, name) if role == "instance" else None  # read first: the kill
        held = self._held_progress(job, name) if role == "instance" else {}  # follows the held progress at once
        waited_until = time.monotonic() + INSTANCE_BUSY_WAIT_S
        while role == "instance" and not held.get("held") and time.monotonic() < waited_until:  # mid-generation
            job.stop.wait(0.05)
            held = self._held_progress(job, name)
        fault = Fault(role, name, how, time.monotonic() - started, tv)
        fault.decode_steps_per_s = decode_rate
        self.faults.append(fault)
        self._started = started
        job.kill(name, signal.SIGSTOP if how == "hang" else signal.SIGKILL)
        fault.regenerated_tokens = self._lost_progress(job, held.get("held", {}))
        if held.get("batches"):
            fault.checkpoint_round_s = held["seconds"] / held["batches"]
        fault.since_checkpoint_round_s = held.get("since_last_round_s")

    def _cycle_seconds(self, coordinator: CoordinatorClient) -> float | None:
        """The coordinator's mean cycle interval (its period, or the cycle's own time where longer):
        how old its last snapshot of a failed instance can be."""
        try:
            stats = coordinator.stats()
        except (httpx.HTTPError, ServiceError, ValueError):
            return None
        return max(self.config.cycle_period, stats.cycle_ms_total / 1e3 / stats.cycles if stats.cycles else 0.0)

    def _decode_rate(self, job: LocalJob, name: str) -> float | None:
        """The instance's decode steps per wall second so far (a step gives each running trajectory
        one token), from its snapshot's counters on the engine's clock."""
        try:
            with InstanceClient(job.endpoints[name]["url"], timeout=2.0) as instance:
                snap = instance.snapshot()
        except (httpx.HTTPError, ServiceError, ValueError):
            return None
        if not snap.decode_steps or not snap.decode_seconds:
            return None
        clock = self.config.speed if self.config.engine == "sim" else 1.0
        return snap.decode_steps / snap.decode_seconds * clock

    @staticmethod
    def _held_progress(job: LocalJob, name: str) -> dict:
        """The instance's held progress, read just before the fault: the response tokens each
        trajectory there holds, and its checkpoint counters."""
        try:
            with InstanceClient(job.endpoints[name]["url"], timeout=2.0) as instance:
                return instance.progress().model_dump()
        except (httpx.HTTPError, ServiceError, ValueError):
            return {}

    @staticmethod
    def _lost_progress(job: LocalJob, held: dict[str, int]) -> list[int]:
        """Per trajectory held on the failed instance, what the trajectory server lacks of it:
        its response resumes from what the trajectory server holds (a finished one lost nothing)."""
        lost = []
        with TrajectoryClient(job.endpoints["ts"]["url"], timeout=5.0) as ts:
            for traj_id, tokens in held.items():
                try:
                    stored = ts.trajectory(traj_id)
                except (httpx.HTTPError, ServiceError, ValueError):
                    continue
                if stored.state in ("routed", "pending"):
                    lost.append(max(tokens - stored.generated, 0))
        return lost

    def _current(self, name: str) -> Fault | None:
        f = self.faults[-1] if self.faults else None
        return f if f is not None and f.name == name and f.restarted_at is None else None

    def _detected(self, name: str, why: str, t: float) -> None:
        fault = self._current(name)
        if fault is not None:
            fault.detected_at, fault.detected_by = t - self._started, why

    def _restarted(self, name: str, t: float) -> None:
        fault = self._current(name)
        if fault is not None:
            fault.restarted_at = t - self._started

    def _recovered(self, fault: Fault, job: LocalJob, probe: Probes) -> bool:
        """The failed role is back in service (not merely restarted)."""
        if fault.restarted_at is None:
            return False
        try:
            if fault.role == "instance" or fault.role == "coordinator":
                listed = probe.coordinator.instances().instances
                wanted = [i for i in listed if fault.role == "coordinator" or i.instance_id == fault.name]
                return bool(wanted) and all(i.status in ("live", "syncing") for i in wanted)
            if fault.role == "trainer":  # back at work: a step trained after the restart
                return any(s.finished_at > fault.restarted_at for s in job.steps())
            return True  # a service: it answered its health probe at the restart
        except (httpx.HTTPError, ServiceError, ValueError):
            return False

    @staticmethod
    def _train_version(manager: ManagerClient, versions: list[int]) -> int | None:
        try:
            tv = manager.buffers().train_version
        except (httpx.HTTPError, ServiceError, ValueError):
            return versions[-1] if versions else None
        versions.append(tv)
        return tv

    @staticmethod
    def _ps_version(params: ParamsApiClient) -> int | None:
        try:
            return params.latest().version
        except (httpx.HTTPError, ServiceError, ValueError):
            return None

    # -- after the run ----------------------------------------------------------------------

    def _verify(self, job: LocalJob, versions: list[int], ps_versions: list[int], result: FaultRunResult) -> None:
        cfg, eta, v = self.config, self.config.ledger.eta, result.violations
        if any(b < a for a, b in zip(versions, versions[1:], strict=False)):
            v.append("the ledger's train version went backwards")
        if any(b < a for a, b in zip(ps_versions, ps_versions[1:], strict=False)):
            v.append("the parameter server's newest version went backwards")
        steps = job.steps()
        trained = [s.version for s in steps]
        if trained != list(range(len(trained))):
            v.append(f"the trainer's versions are not 0, 1, 2, ... once each: {trained}")
        group_size = cfg.ledger.group_size
        for s in steps:
            if s.trajectories != s.groups * group_size:
                v.append(f"step {s.version}: {s.trajectories} trajectories for {s.groups} groups of {group_size}")
            if any(k > eta or k < 0 for k in s.staleness):
                v.append(f"step {s.version}: staleness {s.staleness} outside [0, {eta}]")
        # the ledger's own durable record: every group consumed once, within the bound
        from staleflow.servers.manager.store import consumption_record

        consumed, fates = consumption_record(cfg.database_url() or f"sqlite:///{cfg.state_dir / 'ledger.db'}")
        if len(consumed) != len(set(consumed)):
            v.append(f"{len(consumed) - len(set(consumed))} groups consumed twice")
        if len(consumed) != len(trained) * cfg.ledger.batch_size:
            v.append(f"{len(consumed)} groups consumed for {len(trained)} steps of {cfg.ledger.batch_size}")
        late = [(g, vt, b) for g, vt, b in fates if not 0 <= b - vt <= eta]
        if late:
            v.append(f"{len(late)} consumed groups outside the bound, e.g. {late[0]}")
        lost = self._lost_trajectories(job)
        if lost:
            v.append(f"{len(lost)} trajectories routed to an instance that does not hold them: {lost[:3]}")
        expected = len(trained)
        try:
            from staleflow.transports.client import ParamsClient

            with ParamsClient(job.endpoints["params"]["url"]) as params:
                latest = params.latest().version
                weights = params.pull(latest)["weights"]
            complete = latest == expected and weights.size == cfg.trainer.push_bytes and bool(
                np.all(np.asarray(weights) == latest % 256))
        except Exception as exc:  # reported, not raised: the run's other checks still count
            complete, latest = False, f"unreadable ({exc!r})"
        if not complete:
            v.append(f"the parameter server does not serve a complete version {expected} (newest: {latest})")
        result.checks = {"groups_consumed": len(consumed), "groups_consumed_twice": len(consumed) - len(set(consumed)),
                         "consumed_outside_bound": len(late), "lost_trajectories": len(lost),
                         "train_versions_monotone": not any(b < a for a, b in zip(versions, versions[1:], strict=False)),
                         "ps_latest": latest, "ps_complete": complete}

    @staticmethod
    def _lost_trajectories(job: LocalJob) -> list[str]:
        """Trajectories the TS believes routed to an instance that holds none of them, seen
        twice a second apart (a completion in flight is not lost)."""
        urls = {k: v["url"] for k, v in job.endpoints.items()}
        suspects: set[str] | None = None
        for attempt in range(2):
            now: set[str] = set()
            with TrajectoryClient(urls["ts"], timeout=10) as ts:
                routed = ts.routed().trajectories
            held: dict[str | None, set[str]] = {}
            for t in routed:
                inst = t.instance_id
                if inst not in held:
                    held[inst] = set()
                    if inst in urls:
                        with contextlib.suppress(httpx.HTTPError, ServiceError, ValueError):
                            with InstanceClient(urls[inst], timeout=5) as c:
                                s = c.snapshot()
                            held[inst] = set(s.run_trajs) | set(s.wait_trajs) | set(s.complete_trajs)
                if t.traj_id not in held[inst]:
                    now.add(t.traj_id)
            suspects = now if suspects is None else suspects & now
            if not suspects:
                return []
            if attempt == 0:
                job.stop.wait(1.0)  # let completions in flight land
        return sorted(suspects or ())


# ---------------------------------------------------------------------------- the report


def _one_cycle_tokens(run: FaultRunResult) -> float | None:
    """What the trajectories hit by instance faults generate in one coordinator cycle (each of
    them a token per decode step of its instance): how far the trajectory server's regenerated
    count, from the coordinator's last snapshot, may lie from the harness's."""
    hit = [f for f in run.faults if f.regenerated_tokens]
    rates = [f.decode_steps_per_s for f in hit if f.decode_steps_per_s is not None]
    if run.cycle_s is None or len(rates) < len(hit):
        return None
    return sum(len(f.regenerated_tokens) * rate for f, rate in zip(hit, rates, strict=True)) * run.cycle_s


def summarize(baseline: FaultRunResult | None, faulty: FaultRunResult) -> dict:
    per_role: dict[str, dict] = {}
    for f in faulty.faults:
        r = per_role.setdefault(f"{f.role}" + (" (hung)" if f.how == "hang" else ""), {"faults": 0, "detection_s": [],
                                                                                          "recovery_s": [], "kept": []})
        r["faults"] += 1
        if f.detection_s is not None:
            r["detection_s"].append(f.detection_s)
        if f.recovery_s is not None:
            r["recovery_s"].append(f.recovery_s)
        if f.throughput_kept is not None:
            r["kept"].append(f.throughput_kept)
    regenerated = [n for f in faulty.faults for n in f.regenerated_tokens]
    counted = faulty.failover or {}
    table = {role: {"faults": r["faults"],
                    "detection_s": float(np.mean(r["detection_s"])) if r["detection_s"] else None,
                    "recovery_s": float(np.mean(r["recovery_s"])) if r["recovery_s"] else None,
                    "throughput_kept": float(np.mean(r["kept"])) if r["kept"] else None} for role, r in per_role.items()}
    vs_baseline = baseline.wall_s / faulty.wall_s if baseline and faulty.wall_s and not baseline.violations else None
    pace = faulty.pace_s
    ettr = min(1.0, faulty.steps * pace / faulty.wall_s) if faulty.wall_s else None
    return {"per_role": table, "ettr": ettr, "pace_s": pace, "ettr_vs_baseline": vs_baseline, "faults": len(faulty.faults),
            "steps": faulty.steps,
            "regenerated_tokens": {"trajectories": len(regenerated),
                                   "per_trajectory_mean": float(np.mean(regenerated)) if regenerated else None,
                                   "per_trajectory_max": max(regenerated) if regenerated else None,
                                   "total": sum(regenerated),
                                   # the trajectory server's own count, from the coordinator's last snapshot of the
                                   # failed instance (or the instance's last word, if newer): it may miss what was
                                   # generated in the cycle before the fault
                                   "counted_by_trajectory_server": {
                                       "trajectories": counted.get("regenerated_trajectories"),
                                       "total": counted.get("regenerated_tokens"),
                                       "one_cycle_tokens": _one_cycle_tokens(faulty)}},
            "length_skew": faulty.length_skew,
            "fault_every_steps": None, "baseline_wall_s": baseline.wall_s if baseline else None,
            "faulty_wall_s": faulty.wall_s, "violations": faulty.violations, "checks": faulty.checks,
            "baseline": baseline.to_json() if baseline else None, "faulty": faulty.to_json()}


def write_report(path: Path, report: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
