"""What one simulated run measured (plain data, JSON-ready through ``to_dict``)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class SimStepRecord:
    step: int  # 1-based training step
    buffer: int  # V_buf: the batch trains version buffer -> buffer + 1
    start_s: float  # consumed (training starts)
    end_s: float  # trained
    groups: int
    trajectories: int
    response_tokens: int
    trained_tokens: int  # prompt + response
    mean_response: float
    max_response: int
    staleness: dict[int, int]  # V_buf - V_traj -> trajectories


@dataclass
class Breakdown:
    """Average seconds per training step per rollout instance (cf. paper Table 3)."""

    decode_s: float = 0.0
    prefill_s: float = 0.0  # prefill and re-prefill after routing, migration, preemption
    pull_s: float = 0.0
    route_s: float = 0.0  # Route command latency
    interrupt_s: float = 0.0  # Interrupt and Abort command latency
    train_s: float = 0.0  # colocated systems only: the instance's GPUs are training
    idle_s: float = 0.0  # nothing running, nothing loading, not training

    def fractions(self) -> dict[str, float]:
        values = asdict(self)
        total = sum(values.values())
        return {k: (v / total if total else 0.0) for k, v in values.items()}


@dataclass
class DecisionStats:
    """Wall-clock milliseconds of ``plan_cycle`` per planned cycle (not part of virtual time)."""

    cycles: int = 0  # cycle ticks handled
    planned: int = 0  # plan_cycle calls
    skipped: int = 0  # ticks where nothing could change (no event since the last plan, or provably empty)
    mean_ms: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    total_ms: float = 0.0

    @classmethod
    def of(cls, cycles: int, skipped: int, samples: list[float]) -> DecisionStats:
        if not samples:
            return cls(cycles, 0, skipped)
        ordered = sorted(samples)
        return cls(cycles, len(samples), skipped, statistics.fmean(samples), ordered[len(ordered) // 2],
                   ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], ordered[-1], sum(samples))


@dataclass
class Timeline:
    """Per-instance load over time (Figure 17) and the Pulls (model synchronizations)."""

    instances: list[str]
    times: list[float] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)  # [sample][instance]
    waiting: list[list[int]] = field(default_factory=list)
    syncs: list[tuple[float, int, int]] = field(default_factory=list)  # (time, instance index, version)


@dataclass
class RunResult:
    system: str
    label: str
    family: str
    eta: int
    instances: int
    train_gpus: int
    steps: int
    total_time_s: float  # end of the last training step
    response_tokens: int  # over every trained trajectory
    throughput: float  # response_tokens / total_time_s
    mean_response: float
    max_response: int
    step_records: list[SimStepRecord]
    breakdown: Breakdown
    staleness: dict[int, dict[int, int]]  # V_buf -> {V_buf - V_traj: trajectories}
    violations: int  # trained trajectories outside V_traj <= V_buf <= V_traj + eta (must be 0)
    decisions: DecisionStats
    counters: dict[str, int]
    wall_s: float
    timeline: Timeline | None = None
    exceedances: int = 0  # completion-order systems: trained trajectories older than eta allows (their rule)
    max_exceedance: int = 0  # by how many versions the worst of them exceeded eta
    length_skew: dict | None = None  # trained against generated lengths (``staleflow.length_skew.LengthSkew.to_json``)
    busy_kv_utilisation: float = 0.0  # KV cache held while generating over the budget, time-weighted mean

    @property
    def step_time_s(self) -> float:
        return self.total_time_s / self.steps if self.steps else 0.0

    @property
    def steady_throughput(self) -> float:
        """Throughput of the second half of the steps: response tokens of steps ``k+1..N`` over
        the time from the end of step ``k`` (``k = N // 2``) to the end of step ``N``. It leaves
        out the warm-up (the first batch of an asynchronous system is generated from scratch, like
        a synchronous one's) that a short run's ``throughput`` includes."""
        records = self.step_records
        k = len(records) // 2
        if k < 1:
            return self.throughput
        span = records[-1].end_s - records[k - 1].end_s
        return sum(r.response_tokens for r in records[k:]) / span if span > 0 else self.throughput

    def staleness_total(self) -> dict[int, int]:
        total: dict[int, int] = {}
        for hist in self.staleness.values():
            for s, n in hist.items():
                total[s] = total.get(s, 0) + n
        return dict(sorted(total.items()))

    def realised_staleness(self) -> dict[str, float]:
        """The staleness the run really trained with: ``p99`` and ``max`` of ``V_buf - V_traj`` over
        every trained trajectory and the share of them above the run's eta."""
        total = self.staleness_total()
        count = sum(total.values())
        if not count:
            return {"p99": 0, "max": 0, "over_eta_share": 0.0}
        seen, p99 = 0, 0
        for s, n in total.items():  # ascending
            seen += n
            if seen >= 0.99 * count:
                p99 = s
                break
        over = sum(n for s, n in total.items() if s > self.eta)
        return {"p99": p99, "max": max(total), "over_eta_share": over / count}

    def to_dict(self, timeline: bool = True) -> dict:
        data = asdict(self)
        data["realised_staleness"] = self.realised_staleness()
        data["step_time_s"] = self.step_time_s
        data["steady_throughput"] = self.steady_throughput
        data["breakdown_fractions"] = self.breakdown.fractions()
        data["staleness"] = {str(b): {str(s): n for s, n in h.items()} for b, h in self.staleness.items()}
        for record in data["step_records"]:
            record["staleness"] = {str(s): n for s, n in record["staleness"].items()}
        if not timeline:
            data["timeline"] = None
        return data
