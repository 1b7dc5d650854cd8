"""What one simulated RL job is made of: cluster, engine, trainer, command costs, cycle timing."""

from __future__ import annotations

from dataclasses import dataclass, field

from staleflow.config.engines import SimParams
from staleflow.simulation.systems import SystemSpec
from staleflow.simulation.transfer import WeightTransfer
from staleflow.workload import WorkloadModel


@dataclass(frozen=True)
class TrainerModel:
    """Time of one training step: ``overhead + gpu_seconds_per_token * tokens / gpus``.

    ``tokens`` counts prompt and response tokens of the consumed batch (every member trained).
    ``gpu_seconds_per_token`` covers the forward/backward passes and the log-prob recomputation of
    the RL step. After a step the new weights reach the parameter server ``push_s`` later
    (disaggregated systems; a colocated system's weights are local and its instances only reload).
    """

    gpu_seconds_per_token: float = 1.5e-3
    step_overhead_s: float = 10.0
    push_s: float = 3.0

    def __post_init__(self) -> None:
        if self.gpu_seconds_per_token < 0 or self.step_overhead_s < 0 or self.push_s < 0:
            raise ValueError("trainer times must be >= 0")

    def step_seconds(self, tokens: int, gpus: int) -> float:
        if gpus < 1:
            raise ValueError("the trainer needs at least one GPU")
        return self.step_overhead_s + self.gpu_seconds_per_token * tokens / gpus


@dataclass(frozen=True)
class CommandCosts:
    """Latency of the coordinator's trajectory commands (paper Table 3: Route and Interrupt).

    A command to one instance takes ``command_s + per_traj_s * trajectories``; the trajectories it
    moves take effect only when it lands, and a Route carrying interrupted partials waits for their
    Interrupt to land first. Aborts (redundancy surplus) cost like Interrupts. Pull time is the
    engine's own (``SimParams.pull_seconds``).
    """

    route_command_s: float = 0.005
    route_traj_s: float = 0.001
    interrupt_command_s: float = 0.005
    interrupt_traj_s: float = 0.0005

    def route(self, n: int) -> float:
        return self.route_command_s + self.route_traj_s * n if n else 0.0

    def interrupt(self, n: int) -> float:
        return self.interrupt_command_s + self.interrupt_traj_s * n if n else 0.0


@dataclass(frozen=True)
class SimulatedCluster:
    """One job: a system on a cluster of ``rollout_instances`` SimCores and ``train_gpus`` trainer GPUs.

    ``cycle_period_s``: the coordinator's snapshot-command cycle, in virtual seconds. A cycle is
    planned at the first tick after anything changed (a completion, a landed command, a new
    version, a consumed batch) and otherwise every ``recheck_period_s`` while work is in flight
    (between events only the KV caches grow). ``timeline_period_s``: sampling of per-instance load
    when ``record_timeline``.
    """

    workload: WorkloadModel
    system: SystemSpec
    eta: int
    rollout_instances: int
    train_gpus: int
    sim: SimParams = field(default_factory=SimParams)
    trainer: TrainerModel = field(default_factory=TrainerModel)
    commands: CommandCosts = field(default_factory=CommandCosts)
    cycle_period_s: float = 1.0
    recheck_period_s: float = 5.0
    record_timeline: bool = False
    timeline_period_s: float = 10.0
    straggler_sigma: float = 0.0  # persistent per-instance speed spread (``cluster.straggler_slowdowns``)
    nccl_broadcast_s: float = 8.1  # VeRL-like weight sync: trainer and instances blocked this long
    transfer: WeightTransfer = field(default_factory=WeightTransfer)  # where Pulls come from (a system may override the source)

    def __post_init__(self) -> None:
        if self.eta < 0:
            raise ValueError("eta must be >= 0")
        if self.rollout_instances < 1 or self.train_gpus < 1:
            raise ValueError("need at least one rollout instance and one trainer GPU")
        if self.cycle_period_s <= 0 or self.recheck_period_s < self.cycle_period_s:
            raise ValueError("cycle_period_s must be > 0 and recheck_period_s >= cycle_period_s")
        if self.timeline_period_s <= 0:
            raise ValueError("timeline_period_s must be > 0")
        if self.straggler_sigma < 0 or self.nccl_broadcast_s < 0:
            raise ValueError("straggler_sigma and nccl_broadcast_s must be >= 0")

    @property
    def effective_eta(self) -> int:
        return self.system.eta_for(self.eta)
