"""The trajectory pool: the trajectory server's bookkeeping inside the cluster simulation.

It samples prompt groups from the workload (ids ``s{k}-g{i}`` as ``WorkloadModel.groups`` names
them, members ``/m{j}``), tracks where every trajectory is, and shows the strategies what waits
as ``PendingTrajectory`` records (length = prompt + response so far, FIFO ``seq``). Trajectories
carry token *counts*, never tokens: the simulated engine only needs how much context a resumed
trajectory brings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from staleflow.strategies import PendingTrajectory
from staleflow.workload import WorkloadModel


class TrajStatus(StrEnum):
    PENDING = "pending"  # in the trajectory server, routable
    ASSIGNED = "assigned"  # a Route to ``instance`` is in flight
    RUNNING = "running"  # on ``instance`` (running or queued in the engine)
    DONE = "done"
    ABORTED = "aborted"


class GroupStatus(StrEnum):
    SAMPLED = "sampled"  # no V_traj yet
    RESERVED = "reserved"
    OCCUPIED = "occupied"
    CONSUMED = "consumed"
    ABORTED = "aborted"


LIVE_GROUPS = (GroupStatus.SAMPLED, GroupStatus.RESERVED, GroupStatus.OCCUPIED)


@dataclass(eq=False, slots=True)
class SimTrajectory:
    traj_id: str
    group: SimGroup
    seq: int
    status: TrajStatus = TrajStatus.PENDING
    generated: int = 0  # response tokens so far (final length once done)
    instance: int | None = None
    route_to: int | None = None  # an Interrupt is in flight and a Route to this instance follows it
    oldest_version: int | None = None  # oldest model version that generated any of its tokens
    view: PendingTrajectory | None = None  # as the strategies see it (while pending / since routed)

    @property
    def context(self) -> int:
        return len(self.group.prompt_ids) + self.generated


@dataclass(eq=False, slots=True)
class SimGroup:
    group_id: str
    index: int
    prompt_ids: tuple[int, ...]
    status: GroupStatus = GroupStatus.SAMPLED
    v_traj: int | None = None
    members: list[SimTrajectory] = field(default_factory=list)
    counted: list[SimTrajectory] = field(default_factory=list)  # completed members the ledger counted


class TrajectoryPool:
    def __init__(self, workload: WorkloadModel, batch_size: int, members: int):
        self.workload = workload
        self.batch_size = batch_size
        self.members = members
        self.groups: dict[str, SimGroup] = {}
        self.trajs: dict[str, SimTrajectory] = {}
        self.sampled = 0
        self._seq = 0
        self._pending: dict[str, PendingTrajectory] = {}  # insertion order = arrival order
        self._versioned: set[str] = set()  # pending trajectories whose group has a V_traj
        self.occupied = 0  # groups occupied and not yet consumed

    # ------------------------------------------------------------------ sampling

    def sample(self, n: int) -> list[SimGroup]:
        """``n`` new prompt groups, every member pending."""
        new = []
        for _ in range(n):
            index = self.sampled
            self.sampled += 1
            group_id = f"s{index // self.batch_size}-g{index % self.batch_size}"
            group = SimGroup(group_id, index, self.workload.prompt_ids(group_id))
            for m in range(self.members):
                self._seq += 1
                traj = SimTrajectory(f"{group_id}/m{m}", group, self._seq)
                group.members.append(traj)
                self.trajs[traj.traj_id] = traj
                self._show(traj)
            self.groups[group_id] = group
            new.append(group)
        return new

    def live_groups(self) -> int:
        return sum(g.status in LIVE_GROUPS for g in self.groups.values())

    def forget(self, group: SimGroup) -> None:
        """Drop a finished group's records (its trajectories are no longer referenced)."""
        for t in group.members:
            self.trajs.pop(t.traj_id, None)
            self.take(t)
        self.groups.pop(group.group_id, None)

    # ------------------------------------------------------------------ the trajectory server's queue

    def pending(self) -> list[PendingTrajectory]:
        return list(self._pending.values())

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def versioned_pending(self) -> int:
        """Pending trajectories that already have a V_traj (partials, members of reserved groups)."""
        return len(self._versioned)

    def make_pending(self, traj: SimTrajectory) -> None:
        traj.status, traj.instance, traj.route_to = TrajStatus.PENDING, None, None
        self._show(traj)

    def take(self, traj: SimTrajectory) -> None:
        """A pending trajectory leaves the queue (routed, or aborted)."""
        self._pending.pop(traj.traj_id, None)
        self._versioned.discard(traj.traj_id)

    def set_status(self, group: SimGroup, status: GroupStatus) -> None:
        if group.status is GroupStatus.OCCUPIED:
            self.occupied -= 1
        if status is GroupStatus.OCCUPIED:
            self.occupied += 1
        group.status = status

    def set_version(self, group: SimGroup, v_traj: int) -> None:
        group.v_traj = v_traj
        self.set_status(group, GroupStatus.RESERVED)
        for t in group.members:
            self._show(t)

    def refresh(self, traj: SimTrajectory) -> None:
        """Its length changed (an Interrupt landed): update what the strategies see."""
        self._show(traj)

    def _show(self, traj: SimTrajectory) -> None:
        traj.view = PendingTrajectory(traj.traj_id, traj.group.group_id, traj.group.v_traj, traj.context, traj.seq)
        if traj.status is TrajStatus.PENDING:
            self._pending[traj.traj_id] = traj.view
            if traj.group.v_traj is not None:
                self._versioned.add(traj.traj_id)
