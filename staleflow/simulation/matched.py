"""StaleFlow against the peers that do not keep the bound, at the staleness they really train with.

A peer whose rule lets long groups be trained late (``SystemSpec.keeps_bound`` False: completion
order, AReaL / VeRL-Async-like) runs at a nominal eta but trains some trajectories beyond it.
Comparing it with StaleFlow at the same nominal eta compares a loose system with a strict one.
For every run of such a peer this module reads its realised staleness (p99 and max of
``V_buf - V_traj`` over the trained trajectories) and runs StaleFlow with the bound set to each:
the rows say who is faster at the staleness a user really gets. Which runs are matched, and with
which bound, is the experiment's (``staleflow.simulation.experiment.matched_targets``).
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.simulation.result import RunResult


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


def matched_row(peer_run: RunResult, peer: str, sweep_value: float | None, peer_eta: int, staleflow_eta: int,
                staleflow_run: RunResult) -> MatchedRow:
    """``peer``'s run at nominal ``peer_eta`` against StaleFlow's run with the bound ``staleflow_eta``."""
    realised = peer_run.realised_staleness()
    return MatchedRow(peer, sweep_value, peer_eta, int(realised["p99"]), int(realised["max"]), realised["over_eta_share"],
                      staleflow_eta, peer_run.throughput, staleflow_run)
