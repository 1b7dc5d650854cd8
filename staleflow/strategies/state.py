"""What the coordination strategies reason about: instances, waiting trajectories, admission.

Pure data; the coordinator builds these from validated snapshots, the trajectory server and the
ledger's admission table (asked once per cycle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from staleflow.cost_model import CostModel


@dataclass
class InstanceState:
    """The coordinator's working copy of one instance's snapshot (paper §5.2, Figure 11)."""

    instance_id: str
    version: int
    kv_cache: float
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    cost: CostModel = field(default_factory=CostModel)

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
        else:
            self.waiting.append(traj_id)

    def discard(self, traj_ids: set[str]) -> None:
        """Remove trajectories; the snapshot has no per-trajectory KV, so the KV freed by
        running ones is estimated as their share of the instance's KV cache."""
        still_running = [t for t in self.running if t not in traj_ids]
        if self.running:
            self.kv_cache *= len(still_running) / len(self.running)
        self.running = still_running
        self.waiting = [t for t in self.waiting if t not in traj_ids]

    def copy(self) -> InstanceState:
        return InstanceState(self.instance_id, self.version, self.kv_cache, list(self.running), list(self.waiting), self.cost)


@dataclass(frozen=True)
class PendingTrajectory:
    """A trajectory held by the trajectory server, waiting to be routed."""

    traj_id: str
    group_id: str
    v_traj: int | None  # None: an initial trajectory whose group has no version yet
    length: int  # tokens of context it brings: prompt plus what it generated so far
    seq: int = 0  # arrival order: FIFO within a priority level


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


class RoutingMode(StrEnum):
    THROUGHPUT = "throughput"  # paper Algorithm 3: cost-model waterfall over a multi-level queue
    VANILLA = "vanilla"  # fewest trajectories first, no threshold (§6.5 ablation)


class SyncMode(StrEnum):
    LOAD_AWARE = "load-aware"  # the authors' code: an idle-enough instance with nothing left to run at its version
    SELECTIVE = "selective"  # paper Algorithm 4 as printed: only when it lets routing place work
    GREEDY = "greedy"  # as soon as the PS has a newer version (§6.5 ablation)
    GLOBAL = "global"  # in-flight-limited baselines: all instances together
    NEVER = "never"  # the upper bound: instances keep their weights (no Pull, nothing interrupted)


class MigrationMode(StrEnum):
    STARVED = "starved"  # the authors' code: feed a starved instance from the busiest one, down to a floor
    THROUGHPUT = "throughput"  # paper Algorithm 5 as printed
    NONE = "none"  # trajectories move only when a sync interrupts them (§6.5 ablation)


@dataclass(frozen=True)
class StrategyConfig:
    routing: RoutingMode = RoutingMode.THROUGHPUT
    sync: SyncMode = SyncMode.SELECTIVE
    migration: MigrationMode = MigrationMode.THROUGHPUT
    mu: float = 0.3  # route only when the gain is >= mu x the ideal gain (Eq. 4)
    phi_wait: int = 3  # waiting trajectories tolerated per instance before migrating the excess
    phi_throughput: float = 5.0  # max/min instance throughput ratio that triggers a migration
    max_in_flight: int | None = None  # in-flight-limited baselines: cap on routed trajectories
    # Trajectories that already have a V_traj (partials, members of reserved groups) go to the
    # admissible instance with the largest gain, not through Algorithm 3's oldest-version-first
    # waterfall: their staleness is fixed wherever they run, and the waterfall piled the stalest
    # long partials onto the one old instance with room, which is then the next to be synced
    # (docs/benchmarks.md, "What differs", 4). False: Algorithm 3 as printed.
    versioned_by_gain: bool = True
    # Routing keeps scanning a priority level past a trajectory no instance gains enough from
    # (a shorter one behind it may still fit), as the authors' router does; False: the pass
    # stops at the first withheld trajectory.
    scan_withheld: bool = True
    # Initial trajectories scan version groups by the ledger's remaining admission at their
    # version (fewest first, the authors' "reserve capability" order); False: oldest version first.
    order_by_reserve: bool = False
    # Load-aware sync: a lagging instance syncs once its KV use is at most this share of its
    # budget, its waiting queue is empty and no waiting versioned trajectory may run on it.
    sync_kv_threshold: float = 0.5
    # Starved migration: the instance handed back must hold at least this many trajectories.
    migration_min_trajectories: int = 8
    # A sync hands the instance's own trajectories straight back to it after the Pull (fixed
    # assignment: what a system without migration does); False: they are routed anew.
    pin_partials: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.mu <= 1:
            raise ValueError(f"mu must be within [0, 1], got {self.mu}")
        if self.phi_wait < 0:
            raise ValueError(f"phi_wait must be >= 0, got {self.phi_wait}")
        if self.phi_throughput < 1:
            raise ValueError(f"phi_throughput must be >= 1, got {self.phi_throughput}")
        if not 0 <= self.sync_kv_threshold <= 1:
            raise ValueError(f"sync_kv_threshold must be within [0, 1], got {self.sync_kv_threshold}")
        if self.migration_min_trajectories < 1:
            raise ValueError(f"migration_min_trajectories must be >= 1, got {self.migration_min_trajectories}")
