"""The speculative state P (paper §5.2, Table 1, Eq. 1): what each instance should look like once
every issued command has taken effect. A snapshot is acted on only when it matches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Expectation:
    inst_version: int = 0
    accum_traj_num: int = 0  # trajectories routed since the last Pull, completed ones included


class SpeculativeState:
    def __init__(self) -> None:
        self._expected: dict[str, Expectation] = {}

    def track(self, instance_id: str, inst_version: int = 0, accum_traj_num: int = 0) -> None:
        self._expected[instance_id] = Expectation(inst_version, accum_traj_num)

    def forget(self, instance_id: str) -> None:
        self._expected.pop(instance_id, None)

    def expected(self, instance_id: str) -> Expectation:
        return self._expected[instance_id]

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._expected

    # Table 1: effects of each command on P when it is issued
    def pulled(self, instance_id: str, ps_version: int) -> None:
        e = self._expected[instance_id]
        e.inst_version, e.accum_traj_num = ps_version, 0

    def routed(self, instance_id: str, count: int) -> None:
        self._expected[instance_id].accum_traj_num += count

    def removed(self, instance_id: str, count: int) -> None:
        """Interrupt or Abort of ``count`` trajectories."""
        self._expected[instance_id].accum_traj_num -= count

    def adopt(self, instance_id: str, inst_version: int, trajectories: int) -> None:
        """Reconcile with an observed snapshot after a command whose effect is unknown."""
        self.track(instance_id, inst_version, trajectories)

    # Eq. 1
    def validates(self, instance_id: str, inst_version: int, run: set[str], wait: set[str], complete: set[str]) -> bool:
        e = self._expected.get(instance_id)
        return e is not None and e.inst_version == inst_version and e.accum_traj_num == len(run | wait | complete)
