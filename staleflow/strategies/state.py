"""What the coordination strategies reason about: instances, waiting trajectories, admission.

Pure data; the coordinator builds these from validated snapshots, the trajectory server and the
ledger's admission table (asked once per cycle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from staleflow.cost_model import CostModel


@dataclass
class InstanceState:
    """The coordinator's working copy of one instance's snapshot (paper §5.2, Figure 11)."""

    instance_id: str
    version: int
    kv_cache: float
    running: list[str] = field(default_factory=list[str])
    waiting: list[str] = field(default_factory=list[str])
    cost: CostModel = field(default_factory=CostModel)
    speed: float = 1.0  # observed decode speed over the cost model's (``DecodeSpeeds``): below 1, a straggler
    kv_usage: float | None = None  # the engine's KV utilisation (share of its KV memory), None: not reported

    @property
    def trajectories(self) -> list[str]:
        return self.running + self.waiting

    def throughput(self) -> float:
        return self.cost.throughput(self.kv_cache, len(self.running))

    def marginal_gain(self, length: int) -> float:
        return self.cost.marginal_gain(self.kv_cache, len(self.running), len(self.waiting), length)

    def add(self, traj_id: str, length: int) -> None:
        """Eq. 3's S': the trajectory runs if it fits and nothing queues before it, else it waits."""
        if self.cost.runs_immediately(self.kv_cache, len(self.waiting), length):
            self.running.append(traj_id)
            self.kv_cache += self.cost.kv_units(length)
            if self.kv_usage is not None:
                self.kv_usage += self.cost.kv_units(length) / self.cost.kv_budget
        else:
            self.waiting.append(traj_id)

    def discard(self, traj_ids: set[str]) -> None:
        """Remove trajectories; the snapshot has no per-trajectory KV, so the KV freed by
        running ones is estimated as their share of the instance's KV cache."""
        still_running = [t for t in self.running if t not in traj_ids]
        if self.running:
            share = len(still_running) / len(self.running)
            self.kv_cache *= share
            if self.kv_usage is not None:
                self.kv_usage *= share
        self.running = still_running
        self.waiting = [t for t in self.waiting if t not in traj_ids]

    def copy(self) -> InstanceState:
        return InstanceState(self.instance_id, self.version, self.kv_cache, list(self.running), list(self.waiting), self.cost,
                             self.speed, self.kv_usage)


@dataclass(frozen=True)
class PendingTrajectory:
    """A trajectory held by the trajectory server, waiting to be routed."""

    traj_id: str
    group_id: str
    v_traj: int | None  # None: an initial trajectory whose group has no version yet
    length: int  # tokens of context it brings: prompt plus what it generated so far
    seq: int = 0  # arrival order: FIFO within a priority level
    remaining: float = 0.0  # predicted tokens still to generate (0: no prediction); length-aware routing


class AdmissionBudget:
    """The ledger's admission table, kept exact while a cycle hands out reservations.

    ``admissible[v]`` is the number of new groups with V_traj = v the ledger accepts. It is the
    minimum of the prefix slacks over the buffers a version-v group may use, so one reservation
    at version v lowers the count of every v' >= v by one and caps every v' < v at
    ``admissible[v] - 1``: exactly what the ledger would answer after that reservation.
    """

    def __init__(self, admissible: dict[int, int]):
        self._admissible = dict(admissible)

    def allows(self, v: int) -> bool:
        return self._admissible.get(v, 0) > 0

    def take(self, v: int) -> None:
        if not self.allows(v):
            raise ValueError(f"no admission left for v_traj {v}")
        limit = self._admissible[v] - 1
        for other in self._admissible:
            if other >= v:
                self._admissible[other] -= 1
            else:
                self._admissible[other] = min(self._admissible[other], limit)

    def max_new_groups(self) -> int:
        """An upper bound on the groups one pass can reserve: every ``take`` lowers the largest
        count by one (it lowers every v' >= v and caps every v' < v below the old count at v)."""
        return max(self._admissible.values(), default=0)

    def copy(self) -> AdmissionBudget:
        return AdmissionBudget(self._admissible)

    def as_dict(self) -> dict[int, int]:
        return dict(self._admissible)
