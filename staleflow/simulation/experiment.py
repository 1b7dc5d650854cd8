"""Comparisons of systems on one scenario: sweeps, rollout/training split tuning, ratios.

Every system of a sweep point runs on the same scenario and seed. A disaggregated system tries
each of the scenario's rollout instance counts (the rest of the GPU budget trains) and keeps its
best: at every point (``tune="each"``), or (``"once"``, the default) at one staleness bound per
sweep value, the tuning eta, reusing that split at the other bounds; ``"none"`` takes the middle
candidate. StaleFlow's ablation and redundancy variants reuse the split chosen for full StaleFlow
at the same point (as the paper's ablation holds the configuration fixed); a colocated system uses
every GPU for both phases. Runs are memoised, so an eta-independent baseline runs once per
scenario.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass, field, replace

from staleflow.cost_model import CostModel
from staleflow.simulation.bounded_oracle import heuristic, scenario_job
from staleflow.simulation.cluster import simulate
from staleflow.simulation.matched import MatchedRow, matched_row
from staleflow.simulation.result import RunResult
from staleflow.simulation.scenarios import Scenario
from staleflow.simulation.schedule_bound import schedule_bound
from staleflow.simulation.settings import SimulatedCluster
from staleflow.simulation.systems import IN_FLIGHT_ON_PS, Family, SystemSpec, resolve
from staleflow.transports.egress import GBIT

PAPER_TARGETS = {  # §6.2: StaleFlow's gain over each baseline family, (max, mean)
    Family.SYNCHRONOUS.value: (2.68, 2.01),
    Family.ONE_STEP.value: (1.95, 1.52),
    Family.IN_FLIGHT.value: (1.42, 1.17),
}
TUNE_MODES = ("each", "once", "none")
REFERENCE = "sf-rsm"  # full StaleFlow: its split is reused by its variants
ALL_VANILLA = "sf-xxx"
IN_FLIGHT = "in-flight"
ORACLE = "oracle"
CHECK = IN_FLIGHT_ON_PS.name  # all-vanilla StaleFlow's twin, run at its split for the checked property

SWEEP_KEYS = {
    "eta": "staleness bound",
    "response": "response length limit (tokens)",
    "batch": "batch size (groups)",
    "group": "group size",
    "gpus": "GPU budget",
    "instances": "rollout instances (fixed, no split tuning)",
    "mu": "routing threshold mu",
    "prefill": "prefill seconds per token",
    "kv": "KV budget per instance (tokens)",
    "k5": "KV units per token (Table 4's k1 per unit; the token budget is kept)",
    "train": "trainer GPU-seconds per token",
    "cycle": "coordinator cycle period (s)",
    "straggler_sigma": "persistent per-instance speed spread (log-normal sigma)",
    "nccl": "VeRL-like systems' NCCL weight broadcast (s, trainer blocked)",
    "ps_egress": "the parameter server's egress (Gbit/s), shared by the Pulls it serves",
}


@dataclass(frozen=True)
class Point:
    """One sweep point: a scenario variant and a staleness bound."""

    index: int
    eta: int
    scenario: Scenario
    sweep_value: float | None = None
    instances: int | None = None  # fixed rollout instance count
    mu: float | None = None

    @property
    def label(self) -> str:
        return f"eta={self.eta}" if self.sweep_value is None else f"{_fmt(self.sweep_value)}, eta={self.eta}"


def _fmt(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_sweep(text: str) -> tuple[str, tuple[float, ...]]:
    """``key=v1,v2,...`` -> (key, values)."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or key not in SWEEP_KEYS:
        raise ValueError(f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
    try:
        parsed = tuple(float(v) if any(c in v for c in ".e") else int(v) for v in (x.strip() for x in values.split(","))
                       if v)
    except ValueError:
        raise ValueError(f"--sweep {key}: values must be numbers, got {values!r}") from None
    if not parsed:
        raise ValueError(f"--sweep {key}: no values")
    return key, parsed


def apply_sweep(scenario: Scenario, key: str, value: float) -> tuple[Scenario, int | None, float | None]:
    """The scenario at one sweep value, plus a fixed instance count or mu when the key sets one."""
    w, sim = scenario.workload, scenario.sim
    if key == "response":
        return replace(scenario, workload=replace(w, max_response_tokens=int(value))), None, None
    if key == "batch":
        return replace(scenario, workload=replace(w, batch_size=int(value))), None, None
    if key == "group":
        return replace(scenario, workload=replace(w, group_size=int(value))), None, None
    if key == "gpus":
        return scenario.with_gpus(int(value)), None, None
    if key == "instances":
        scenario.train_gpus(int(value))
        return scenario, int(value), None
    if key == "mu":
        return scenario, None, float(value)
    if key == "prefill":
        return replace(scenario, sim=replace(sim, prefill_seconds_per_token=float(value))), None, None
    if key == "kv":
        cost: CostModel = replace(sim.cost, kv_budget=float(value) * sim.cost.k5)
        return replace(scenario, sim=replace(sim, cost=cost)), None, None
    if key == "k5":
        tokens = sim.cost.kv_budget / sim.cost.k5
        cost = replace(sim.cost, k5=float(value), kv_budget=tokens * float(value))
        return replace(scenario, sim=replace(sim, cost=cost)), None, None
    if key == "train":
        return replace(scenario, trainer=replace(scenario.trainer, gpu_seconds_per_token=float(value))), None, None
    if key == "straggler_sigma":
        if value < 0:
            raise ValueError("--sweep straggler_sigma: values must be >= 0")
        return replace(scenario, straggler_sigma=float(value)), None, None
    if key == "nccl":
        if value < 0:
            raise ValueError("--sweep nccl: values must be >= 0")
        return replace(scenario, nccl_broadcast_s=float(value)), None, None
    if key == "ps_egress":
        if not value > 0:
            raise ValueError("--sweep ps_egress: values must be > 0 (Gbit/s)")
        return replace(scenario, transfer=replace(scenario.transfer, ps_egress_bytes_per_s=value * GBIT)), None, None
    if key == "cycle":
        period = float(value)
        return replace(scenario, cycle_period_s=period, recheck_period_s=max(period, scenario.recheck_period_s)), None, None
    raise ValueError(f"unknown sweep key {key!r}")


@dataclass(frozen=True)
class SimulatedJob:
    """One simulation: a system at a point with a rollout instance count."""

    point: Point
    system: SystemSpec
    instances: int
    steps: int
    timeline: bool = False

    def config(self) -> SimulatedCluster:
        s = self.point.scenario
        system = self.system
        if self.point.mu is not None:
            system = replace(system, strategy=replace(system.strategy, mu=self.point.mu))
        return SimulatedCluster(
            workload=s.workload, system=system, eta=self.point.eta, rollout_instances=self.instances,
            train_gpus=s.total_gpus if system.colocated else s.train_gpus(self.instances), sim=s.sim,
            trainer=s.trainer, commands=s.commands, cycle_period_s=s.cycle_period_s,
            recheck_period_s=s.recheck_period_s, record_timeline=self.timeline, timeline_period_s=s.cycle_period_s,
            straggler_sigma=s.straggler_sigma, nccl_broadcast_s=s.nccl_broadcast_s, transfer=s.transfer,
        )

    def key(self) -> tuple:
        eta = self.system.eta_for(self.point.eta)
        return self.system.name, eta, self.point.scenario, self.point.mu, self.instances, self.steps, self.timeline


def run_job(job: SimulatedJob) -> RunResult:
    """Run one job (a top-level function, so process pools can pickle it)."""
    return simulate(job.config(), job.steps)


@dataclass(frozen=True)
class ExperimentSpec:
    scenario: Scenario
    systems: tuple[SystemSpec, ...]
    etas: tuple[int, ...]
    steps: int
    sweep_key: str | None = None
    sweep_values: tuple[float, ...] = ()
    tune: str | bool = "once"  # "each" point, "once" per sweep value (at tune_eta), "none" (middle candidate)
    detail_eta: int | None = None  # record per-instance timelines of StaleFlow and all-vanilla StaleFlow here
    instances: int | None = None  # fix the rollout instance count of every disaggregated system

    def __post_init__(self) -> None:
        if not self.systems or not self.etas or self.steps < 1:
            raise ValueError("need systems, staleness bounds and steps >= 1")
        if any(e < 0 for e in self.etas):
            raise ValueError("staleness bounds must be >= 0")
        if self.sweep_key == "eta":
            raise ValueError("sweep eta through etas")
        if isinstance(self.tune, bool):
            object.__setattr__(self, "tune", "each" if self.tune else "none")
        if self.tune not in TUNE_MODES:
            raise ValueError(f"tune must be one of {', '.join(TUNE_MODES)}, got {self.tune!r}")

    @property
    def tune_eta(self) -> int:
        """The staleness bound at which ``tune="once"`` tries every split: the detail eta if it is
        swept, else the largest."""
        return self.detail_eta if self.detail_eta in self.etas else max(self.etas)

    def points(self) -> list[Point]:
        points: list[Point] = []
        values: Iterable[float | None] = self.sweep_values if self.sweep_key else (None,)
        for value in values:
            scenario, instances, mu = (self.scenario, None, None) if value is None else apply_sweep(
                self.scenario, self.sweep_key, value)  # type: ignore[arg-type]
            instances = instances if instances is not None else self.instances
            if instances is not None:
                scenario.train_gpus(instances)
            for eta in self.etas:
                points.append(Point(len(points), eta, scenario, value, instances, mu))
        return points


@dataclass
class PointResult:
    point: Point
    runs: dict[str, RunResult] = field(default_factory=dict)  # best run per system
    tried: dict[str, dict[int, float]] = field(default_factory=dict)  # system -> {instances: throughput}
    checks: dict[str, RunResult] = field(default_factory=dict)  # runs for checked properties, not rows
    oracle_eta: float | None = None  # the upper bound under the staleness bound (schedule_bound)
    oracle_eta_schedule: float | None = None  # the best clairvoyant schedule found under it (bounded_oracle)

    def same_split_ratio(self, system: str, baseline: str) -> float | None:
        """``system`` over ``baseline`` run with the same rollout/training split (None if not run)."""
        run = self.runs.get(system)
        other = self.tried.get(baseline, {}).get(run.instances) if run else None
        return run.throughput / other if run and other else None

    def oracle_share(self, system: str) -> float | None:
        """``system``'s throughput as a share of the upper bound's at this point."""
        run, oracle = self.runs.get(system), self.runs.get(ORACLE)
        return run.throughput / oracle.throughput if run and oracle and oracle.throughput > 0 else None

    def oracle_eta_share(self, system: str) -> float | None:
        """``system``'s throughput as a share of ``oracle-eta``'s, the upper bound under the same
        staleness bound, at this point (never above 1 for a system that keeps the bound)."""
        run = self.runs.get(system)
        return run.throughput / self.oracle_eta if run and self.oracle_eta else None

    def above_oracle_eta(self, systems: Iterable[SystemSpec]) -> list[str]:
        """Those of ``systems`` that keep the bound and pass ``oracle-eta`` here: each one a flaw of
        the bound (none is expected)."""
        keep = {s.name for s in systems if s.keeps_bound}
        return [name for name, run in self.runs.items()
                if name in keep and self.oracle_eta and run.throughput > self.oracle_eta]

    def gap_recovered(self, system: str, baseline: str = IN_FLIGHT) -> float | None:
        """How much of ``baseline``'s gap to the upper bound ``system`` closes (1: all of it)."""
        run, base, oracle = self.runs.get(system), self.runs.get(baseline), self.runs.get(ORACLE)
        if not (run and base and oracle) or oracle.throughput <= base.throughput:
            return None
        return (run.throughput - base.throughput) / (oracle.throughput - base.throughput)

    def ratios(self, system: str, steady: bool = False) -> dict[str, float]:
        """Throughput of ``system`` over each baseline family's run at this point (``steady``:
        of the second half of the steps, ``RunResult.steady_throughput``)."""
        run = self.runs.get(system)
        out = {}
        if run is None:
            return out
        for other in self.runs.values():
            if other.family not in (Family.STALEFLOW.value, Family.ORACLE.value) and other.throughput > 0:
                out[other.family] = (run.steady_throughput / other.steady_throughput if steady
                                     else run.throughput / other.throughput)
        return out


@dataclass
class ExperimentResult:
    spec: ExperimentSpec
    points: list[PointResult]
    wall_s: float = 0.0
    matched: list[MatchedRow] = field(default_factory=list)  # StaleFlow at each bound-breaking peer's realised staleness

    def summary(self, system: str = REFERENCE) -> dict:
        """Mean and max gain of ``system`` over each baseline family, against the paper's numbers,
        plus how close all-vanilla StaleFlow comes to the in-flight-limited baseline."""
        out: dict = {"system": system}
        for key, steady in (("vs", False), ("steady_vs", True)):
            gains: dict[str, list[float]] = {}
            for p in self.points:
                for family, ratio in p.ratios(system, steady).items():
                    gains.setdefault(family, []).append(ratio)
            out[key] = {}
            for family, values in gains.items():
                paper = PAPER_TARGETS.get(family)
                out[key][family] = {
                    "mean": statistics.fmean(values), "max": max(values), "min": min(values), "n": len(values),
                    "paper_max": paper[0] if paper else None, "paper_mean": paper[1] if paper else None,
                }
        vanilla = [p.same_split_ratio(ALL_VANILLA, CHECK) for p in self.points]
        vanilla = [v for v in vanilla if v is not None]
        out["all_vanilla_vs_in_flight"] = {"mean": statistics.fmean(vanilla), "max_deviation": max(
            abs(v - 1) for v in vanilla)} if vanilla else None
        runs = [r for p in self.points for r in (*p.runs.values(), *p.checks.values())]
        runs += [m.staleflow for m in self.matched]
        out["violations"] = sum(r.violations for r in runs)
        out["runs"] = len(runs)
        out["exceedances"] = {}
        for name in self._systems():
            mine = [r for p in self.points if (r := p.runs.get(name))]
            out["exceedances"][name] = {"count": sum(r.exceedances for r in mine),
                                        "max": max((r.max_exceedance for r in mine), default=0),
                                        "trained": sum(x.trajectories for r in mine for x in r.step_records)}
        out["oracle_share"] = {}
        for name in self._systems():
            shares = [v for p in self.points if (v := p.oracle_share(name)) is not None]
            if shares:
                out["oracle_share"][name] = {"mean": statistics.fmean(shares), "min": min(shares), "max": max(shares)}
        out["oracle_eta_share"] = {}
        for name in self._systems():
            shares = [v for p in self.points if (v := p.oracle_eta_share(name)) is not None]
            if shares:
                out["oracle_eta_share"][name] = {"mean": statistics.fmean(shares), "min": min(shares),
                                                 "max": max(shares)}
        out["above_oracle_eta"] = [f"{name} at {p.point.label}" for p in self.points
                                   for name in p.above_oracle_eta(self.spec.systems)]
        out["realised_staleness"] = {name: [r.realised_staleness() for p in self.points if (r := p.runs.get(name))]
                                     for name in self._systems()}
        out["matched"] = {"n": len(self.matched), "min_ratio": min(m.ratio for m in self.matched),
                          "mean_ratio": statistics.fmean(m.ratio for m in self.matched)} if self.matched else None
        recovered = [v for p in self.points if (v := p.gap_recovered(system)) is not None]
        out["gap_recovered"] = {"mean": statistics.fmean(recovered), "min": min(recovered),
                                "n": len(recovered)} if recovered else None
        return out

    def _systems(self) -> list[str]:
        return [s.name for s in self.spec.systems]

    def to_dict(self, timelines: bool = False) -> dict:
        spec = self.spec
        s = spec.scenario
        return {
            "scenario": {
                "name": s.name, "workload": s.workload.name, "batch_size": s.workload.batch_size,
                "group_size": s.workload.group_size, "max_response_tokens": s.workload.max_response_tokens,
                "total_gpus": s.total_gpus, "gpus_per_instance": s.gpus_per_instance,
                "rollout_candidates": list(s.rollout_candidates), "cycle_period_s": s.cycle_period_s,
                "prefill_seconds_per_token": s.sim.prefill_seconds_per_token,
                "trainer_gpu_seconds_per_token": s.trainer.gpu_seconds_per_token, "seed": s.workload.seed,
                "kv_budget_tokens": s.sim.cost.kv_budget / s.sim.cost.k5, "max_num_seqs": s.sim.max_running,
                "straggler_sigma": s.straggler_sigma, "nccl_broadcast_s": s.nccl_broadcast_s,
                "weight_source": s.transfer.source.value,
                "ps_egress_gbps": (s.transfer.ps_egress_bytes_per_s / GBIT if math.isfinite(s.transfer.ps_egress_bytes_per_s)
                                   else None),
                "pull_bandwidth_gbps": s.sim.pull_bandwidth_bytes_per_s / GBIT,
            },
            "systems": [x.name for x in spec.systems],
            "etas": list(spec.etas),
            "steps": spec.steps,
            "sweep": {"key": spec.sweep_key, "values": list(spec.sweep_values)} if spec.sweep_key else None,
            "points": [
                {
                    "label": p.point.label, "eta": p.point.eta, "sweep_value": p.point.sweep_value,
                    "runs": {name: r.to_dict(timeline=timelines) for name, r in p.runs.items()},
                    "tried": {name: {str(n): thr for n, thr in t.items()} for name, t in p.tried.items()},
                    "ratios": {name: p.ratios(name) for name in p.runs},
                    "oracle_share": {name: p.oracle_share(name) for name in p.runs},
                    "oracle_eta": p.oracle_eta,
                    "oracle_eta_schedule": p.oracle_eta_schedule,
                    "oracle_eta_share": {name: p.oracle_eta_share(name) for name in p.runs},
                    "checks": {name: r.to_dict(timeline=False) for name, r in p.checks.items()},
                }
                for p in self.points
            ],
            "matched": [m.to_dict() for m in self.matched],
            "summary": self.summary(),
            "wall_s": self.wall_s,
        }


def _candidates(spec: ExperimentSpec, point: Point, system: SystemSpec) -> list[int]:
    s = point.scenario
    if system.colocated:
        return [s.colocated_instances]
    if point.instances is not None:
        return [point.instances]
    if spec.tune == "each" or (spec.tune == "once" and point.eta == spec.tune_eta):
        return list(s.rollout_candidates)
    return [s.rollout_candidates[len(s.rollout_candidates) // 2]]


def _tuned_later(spec: ExperimentSpec, point: Point, system: SystemSpec) -> bool:
    """Whether ``system`` at ``point`` reuses the split it found at the tuning eta."""
    return (spec.tune == "once" and point.eta != spec.tune_eta and not system.colocated
            and point.instances is None and len(point.scenario.rollout_candidates) > 1)


def _tune_point(points: list[Point], point: Point, eta: int) -> Point:
    return next(p for p in points if p.sweep_value == point.sweep_value and p.eta == eta)


def plan_jobs(spec: ExperimentSpec) -> tuple[list[Point], list[SimulatedJob], list[tuple[Point, SystemSpec]]]:
    """The points, the jobs runnable now, and the (point, system) pairs that wait for a split:
    StaleFlow's (its variants), or their own at the tuning eta (``tune="once"``)."""
    points = spec.points()
    names = {s.name for s in spec.systems}
    now: list[SimulatedJob] = []
    later: list[tuple[Point, SystemSpec]] = []
    for point in points:
        for system in spec.systems:
            timeline = spec.detail_eta == point.eta and system.name in (REFERENCE, ALL_VANILLA)
            own = system.tuned or REFERENCE not in names  # chooses its own split
            if (not own and not system.colocated and point.instances is None) or (
                    own and _tuned_later(spec, point, system)):
                later.append((point, system))
                continue
            now += [SimulatedJob(point, system, n, spec.steps, timeline) for n in _candidates(spec, point, system)]
    return points, now, later


def _splits(point: Point) -> tuple[int, ...]:
    return (point.instances,) if point.instances is not None else point.scenario.rollout_candidates


def oracle_eta_throughput(spec: ExperimentSpec, point: Point) -> float:
    """``oracle-eta`` at a point: the upper bound on any schedule under the staleness bound
    (``schedule_bound``), at its best split."""
    return max(schedule_bound(scenario_job(point.scenario, point.eta, spec.steps, n)).throughput
               for n in _splits(point))


def oracle_eta_schedule_throughput(spec: ExperimentSpec, point: Point) -> float:
    """The best clairvoyant schedule found under the staleness bound (``bounded_oracle.heuristic``),
    at its best split: ``oracle-eta``'s lower partner, the best schedule lies between the two."""
    return max(heuristic(scenario_job(point.scenario, point.eta, spec.steps, n)).throughput for n in _splits(point))


@dataclass(frozen=True)
class MatchedTarget:
    """A peer's run and the StaleFlow run that matches one of its realised staleness figures."""

    peer: SystemSpec
    run: RunResult
    point: Point  # the peer's
    staleflow_point: Point  # the peer's with eta set to its realised p99 or max
    instances: int  # StaleFlow's split


def matched_targets(points: list[PointResult], peers: list[SystemSpec],
                    split_of: dict[float | None, int]) -> list[MatchedTarget]:
    """For every run of a bound-breaking peer: StaleFlow at eta = its realised p99, then its max
    (one job when they are equal), at StaleFlow's split for that sweep value (``split_of``; else
    the peer's)."""
    targets = []
    for pr in points:
        for peer in peers:
            run = pr.runs.get(peer.name)
            if run is None:
                continue
            realised = run.realised_staleness()
            instances = split_of.get(pr.point.sweep_value, run.instances)
            for eta in sorted({int(realised["p99"]), int(realised["max"])}):
                targets.append(MatchedTarget(peer, run, pr.point, replace(pr.point, eta=eta), instances))
    return targets


def run_experiment(
    spec: ExperimentSpec,
    executor: Executor | None = None,
    on_run: Callable[[SimulatedJob, RunResult], None] | None = None,
) -> ExperimentResult:
    """Run every job (in ``executor`` if given) and keep each system's best split per point."""
    started = time.perf_counter()
    points, jobs, later = plan_jobs(spec)
    results: dict[tuple, RunResult] = {}
    by_point = {p.index: PointResult(p) for p in points}

    def record(job: SimulatedJob, run: RunResult) -> None:
        pr = by_point[job.point.index]
        pr.tried.setdefault(job.system.name, {})[job.instances] = run.throughput
        if job.system.name == CHECK:
            pr.checks[CHECK] = run
            return
        best = pr.runs.get(job.system.name)
        if best is None or run.throughput > best.throughput:
            pr.runs[job.system.name] = run

    def run_all(batch: list[SimulatedJob]) -> None:
        unique: dict[tuple, SimulatedJob] = {}
        for job in batch:
            if job.key() not in results:
                unique.setdefault(job.key(), job)
        todo = list(unique.values())
        if executor is None:
            for job in todo:
                results[job.key()] = run = run_job(job)
                if on_run:
                    on_run(job, run)
        else:
            futures = {executor.submit(run_job, job): job for job in todo}
            for future in as_completed(futures):
                job = futures[future]
                results[job.key()] = run = future.result()
                if on_run:
                    on_run(job, run)

    def execute(batch: list[SimulatedJob]) -> None:
        run_all(batch)
        for job in batch:
            record(job, results[job.key()])

    execute(jobs)
    second = []
    names = {s.name for s in spec.systems}
    for job in jobs:  # all-vanilla StaleFlow ran at a split of its own (fixed instances, no StaleFlow to follow)
        if job.system.name == ALL_VANILLA:
            second.append(SimulatedJob(job.point, IN_FLIGHT_ON_PS, job.instances, spec.steps))
    for point, system in later:
        if system.tuned or REFERENCE not in names:  # its own split at the tuning eta
            source, name = _tune_point(points, point, spec.tune_eta), system.name
        else:  # StaleFlow's split at this point, i.e. at the tuning eta when tuned once
            source = _tune_point(points, point, spec.tune_eta) if _tuned_later(spec, point, system) else point
            name = REFERENCE
        reference = by_point[source.index].runs.get(name)
        instances = reference.instances if reference else _candidates(spec, point, system)[0]
        timeline = spec.detail_eta == point.eta and system.name in (REFERENCE, ALL_VANILLA)
        second.append(SimulatedJob(point, system, instances, spec.steps, timeline))
        if system.name == ALL_VANILLA:  # the all-vanilla check: in-flight on StaleFlow's PS and engine, same split
            second.append(SimulatedJob(point, IN_FLIGHT_ON_PS, instances, spec.steps))
    execute(second)
    order = {s.name: k for k, s in enumerate(spec.systems)}
    for pr in by_point.values():
        pr.runs = dict(sorted(pr.runs.items(), key=lambda kv: order[kv[0]]))
        pr.oracle_eta = oracle_eta_throughput(spec, pr.point)
        pr.oracle_eta_schedule = oracle_eta_schedule_throughput(spec, pr.point)
    ordered = [by_point[p.index] for p in points]
    targets = matched_targets(ordered, [s for s in spec.systems if s.bound_breaking_peer], _staleflow_splits(spec, ordered))
    staleflow = next((s for s in spec.systems if s.name == REFERENCE), None) or resolve(REFERENCE)[0]
    jobs = [SimulatedJob(t.staleflow_point, staleflow, t.instances, spec.steps) for t in targets]
    run_all(jobs)
    matched = [matched_row(t.run, t.peer.name, t.point.sweep_value, t.point.eta, t.staleflow_point.eta, results[job.key()])
               for t, job in zip(targets, jobs, strict=True)]
    return ExperimentResult(spec, ordered, time.perf_counter() - started, matched)


def _staleflow_splits(spec: ExperimentSpec, points: list[PointResult]) -> dict[float | None, int]:
    """StaleFlow's rollout instance count per sweep value (its split at the tuning eta), for the
    runs at a peer's realised staleness."""
    splits: dict[float | None, int] = {}
    for pr in points:
        run = pr.runs.get(REFERENCE)
        if run is not None and (pr.point.eta == spec.tune_eta or pr.point.sweep_value not in splits):
            splits[pr.point.sweep_value] = run.instances
    return splits
