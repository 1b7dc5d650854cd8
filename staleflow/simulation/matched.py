"""StaleFlow against the peers that do not keep the bound, at the staleness they really train with.

A peer whose rule lets long groups be trained late (``SystemSpec.keeps_bound`` False: completion
order, AReaL / VeRL-Async-like) runs at a nominal eta but trains some trajectories beyond it.
Comparing it with StaleFlow at the same nominal eta compares a loose system with a strict one.
For every run of such a peer this module reads its realised staleness (p99 and max of
``V_buf - V_traj`` over the trained trajectories) and runs StaleFlow with the bound set to each:
the rows say who is faster at the staleness a user really gets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from staleflow.simulation.result import RunResult
from staleflow.simulation.systems import SystemSpec

if TYPE_CHECKING:
    from staleflow.simulation.experiment import Point, PointResult


@dataclass(frozen=True)
class MatchedRow:
    """One peer run against StaleFlow run with eta = one of the peer's realised staleness figures."""

    peer: str
    sweep_value: float | None
    peer_eta: int  # the peer's nominal bound
    realised_p99: int  # the peer's realised staleness
    realised_max: int
    over_eta_share: float  # the peer's trained trajectories above its nominal eta
    staleflow_eta: int  # the bound StaleFlow ran with (the peer's p99 or its max)
    peer_throughput: float
    staleflow: RunResult

    @property
    def ratio(self) -> float:
        """StaleFlow's throughput over the peer's."""
        return self.staleflow.throughput / self.peer_throughput if self.peer_throughput > 0 else float("inf")

    def to_dict(self) -> dict:
        return {"peer": self.peer, "sweep_value": self.sweep_value, "peer_eta": self.peer_eta,
                "realised_p99": self.realised_p99, "realised_max": self.realised_max,
                "over_eta_share": self.over_eta_share, "staleflow_eta": self.staleflow_eta,
                "ratio": self.ratio, "peer_throughput": self.peer_throughput,
                "staleflow_throughput": self.staleflow.throughput, "staleflow_instances": self.staleflow.instances,
                "staleflow_violations": self.staleflow.violations,
                "staleflow_realised_p99": self.staleflow.realised_staleness()["p99"]}


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


def matched_row(target: MatchedTarget, staleflow_run: RunResult) -> MatchedRow:
    realised = target.run.realised_staleness()
    return MatchedRow(target.peer.name, target.point.sweep_value, target.point.eta, int(realised["p99"]),
                      int(realised["max"]), realised["over_eta_share"], target.staleflow_point.eta,
                      target.run.throughput, staleflow_run)
