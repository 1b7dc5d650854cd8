"""The coordination strategy's settings (``StrategyConfig``): which routing, sync and migration
rules the coordinator and the simulator run (``staleflow.strategies``), and their thresholds."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RoutingMode(StrEnum):
    THROUGHPUT = "throughput"  # paper Algorithm 3: cost-model waterfall over a multi-level queue
    VANILLA = "vanilla"  # fewest trajectories first, no threshold (§6.5 ablation)


class SyncMode(StrEnum):
    LOAD_AWARE = "load-aware"  # the authors' code: an idle-enough instance with nothing left to run at its version
    SELECTIVE = "selective"  # paper Algorithm 4 as printed: only when it lets routing place work
    GREEDY = "greedy"  # as soon as the PS has a newer version (§6.5 ablation)
    GLOBAL = "global"  # in-flight-limited baselines: all instances together
    NEVER = "never"  # the upper bound: instances keep their weights (no Pull, nothing interrupted)


class PullMode(StrEnum):
    """What a Pull does to the trajectories on the instance."""

    INTERRUPT = "interrupt"  # paper §5.2: interrupt and hand back everything; resumed ones re-prefill
    # in-flight weight update (PipelineRL-style): running trajectories stay, keep their KV cache and
    # continue on the new weights after the load; their V_traj (the oldest version of any of their
    # tokens) is unchanged, so the staleness bound holds as defined
    KEEP = "keep"
    # per Pull: keep unless the instance's trajectories would decode markedly faster on a peer (a
    # straggler, or a still-loaded instance while its peers run dry): then interrupt them
    AUTO = "auto"


class MigrationMode(StrEnum):
    """Which rules move trajectories between instances: a load balance (starved-instance migration
    or Algorithm 5), Laminar's KV-driven repack (``staleflow.strategies.repack``), or both."""

    STARVED = "starved"  # the authors' code: feed a starved instance from the busiest one, down to a floor
    THROUGHPUT = "throughput"  # paper Algorithm 5 as printed
    REPACK = "repack"  # Laminar's repack alone: consolidate ramping-down instances of a version group
    BOTH = "both"  # Algorithm 5 and repack
    STARVED_REPACK = "starved+repack"  # starved-instance migration and repack
    NONE = "none"  # trajectories move only when a sync interrupts them (§6.5 ablation)

    @property
    def balance(self) -> MigrationMode:
        """The load-balancing rule it runs: ``STARVED``, ``THROUGHPUT`` or ``NONE``."""
        return {MigrationMode.BOTH: MigrationMode.THROUGHPUT, MigrationMode.STARVED_REPACK: MigrationMode.STARVED,
                MigrationMode.REPACK: MigrationMode.NONE}.get(self, self)

    @property
    def repacks(self) -> bool:
        return self in (MigrationMode.REPACK, MigrationMode.BOTH, MigrationMode.STARVED_REPACK)


@dataclass(frozen=True)
class StrategyConfig:
    routing: RoutingMode = RoutingMode.THROUGHPUT
    sync: SyncMode = SyncMode.SELECTIVE
    migration: MigrationMode = MigrationMode.THROUGHPUT
    pull: PullMode = PullMode.INTERRUPT
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
    # PullMode.AUTO: a Pull keeps the trajectories when the tokens per second each of them gets
    # where it is (Eq. 11 at the instance's observed speed) are at least this share of what the
    # best peer would give it; otherwise it interrupts them and routing spreads them.
    keep_share: float = 0.5
    # Routing weighs each instance's marginal gain (Eq. 3) by its observed decode speed
    # (``InstanceState.speed``): a straggler's tokens come slower than the cost model predicts.
    route_by_speed: bool = False
    # Length-aware routing: each priority level is routed longest predicted remainder first (the
    # ``remaining`` tokens a ``LengthPredictor`` expects of each waiting trajectory), so long work
    # starts early on the instances with the most room and short work fills the tail; False:
    # arrival order within a level.
    length_aware: bool = False
    # Speculative over-reservation: with batch redundancy in the ledger (its capacity above B), the
    # extra groups are reserved only while the groups the next buffer waits for have a long
    # predicted tail (``over_reservation``); False: the ledger's whole capacity is used.
    adaptive_redundancy: bool = False
    # Adaptive redundancy uses none of the extra groups while the longest predicted remainder of the
    # groups the next buffer waits for is at most this many times a typical trajectory's length,
    # all of them from twice that on, a proportional share in between.
    tail_threshold: float = 2.5
    # Repack (``migration`` repack, both or starved+repack): C_max, the KV utilisation a
    # destination may reach, as a share of the engine's KV budget (Laminar: 99 %).
    repack_kv_share: float = 0.99
    # Repack's B: the most trajectories a destination may run. None: the roofline batch of the
    # cost model, the largest batch whose decode step (KV aside) takes at most ``repack_step_growth``
    # more than a one-trajectory step (``repack.roofline_batch``).
    repack_batch: int | None = None
    repack_step_growth: float = 0.1
    # Seconds between repack checks (Laminar: about 5 s); one also follows every new version.
    repack_period_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.mu <= 1:
            raise ValueError(f"mu must be within [0, 1], got {self.mu}")
        if self.phi_wait < 0:
            raise ValueError(f"phi_wait must be >= 0, got {self.phi_wait}")
        if self.phi_throughput < 1:
            raise ValueError(f"phi_throughput must be >= 1, got {self.phi_throughput}")
        if not 0 <= self.sync_kv_threshold <= 1:
            raise ValueError(f"sync_kv_threshold must be within [0, 1], got {self.sync_kv_threshold}")
        if not 0 <= self.keep_share <= 1:
            raise ValueError(f"keep_share must be within [0, 1], got {self.keep_share}")
        if self.tail_threshold <= 0:
            raise ValueError(f"tail_threshold must be > 0, got {self.tail_threshold}")
        if not 0 < self.repack_kv_share <= 1:
            raise ValueError(f"repack_kv_share must be within (0, 1], got {self.repack_kv_share}")
        if self.repack_batch is not None and self.repack_batch < 2:
            raise ValueError(f"repack_batch must be >= 2 (a destination holds its own and a source's), "
                             f"got {self.repack_batch}")
        if self.repack_step_growth < 0:
            raise ValueError(f"repack_step_growth must be >= 0, got {self.repack_step_growth}")
        if self.repack_period_s <= 0:
            raise ValueError(f"repack_period_s must be > 0, got {self.repack_period_s}")
        if self.migration_min_trajectories < 1:
            raise ValueError(f"migration_min_trajectories must be >= 1, got {self.migration_min_trajectories}")
