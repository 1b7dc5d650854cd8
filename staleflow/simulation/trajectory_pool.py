"""The trajectory pool: the trajectory server's bookkeeping inside the cluster simulation.

The states and every transition are the trajectory server's own ``TrajectoryBook``
(``staleflow.trajectory_book``), driven the way the services drive it: checkouts reserve new
groups in the ledger first (``reservations_needed`` / ``grant``), completions are rewarded at
once and a group with enough rewarded members is occupied in the ledger and closed, and every
ledger transition is followed (``follow_ledger``). This module adds no rule of its own; it keeps
what the simulation needs beside the book's records (``SimTrajectory``): token *counts* instead of
tokens (the simulated engine only needs how much context a resumed trajectory brings), the
oldest model version that generated any of its tokens, which engine holds it, and the trajectory
as the strategies see it (``PendingTrajectory``: length = prompt + response so far, FIFO ``seq``).

Groups are sampled from the workload with its ids (``s{k}-g{i}`` as ``WorkloadModel.groups``
names them, members ``/m{j}``): the simulated engines draw their lengths from those ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from staleflow.ledger import LedgerError, Transition
from staleflow.length_skew import LengthSkew, TrajectoryFate
from staleflow.strategies import PendingTrajectory
from staleflow.trajectory_book import (
    LIVE_GROUP_STATES,
    Generated,
    GroupRecord,
    GroupState,
    TrajectoryBook,
    TrajRecord,
    TrajState,
)
from staleflow.workload import WorkloadModel

SIM_REWARD = (0.0, "simulated")
"""Every completion's reward: the simulation models no reward (no group is filtered)."""


@dataclass(eq=False, slots=True)
class SimTrajectory:
    """What the simulation keeps beside a trajectory's record in the book."""

    traj_id: str
    record: TrajRecord
    group: GroupRecord
    generated: int = 0  # response tokens so far (final length once done)
    engine: int | None = None  # the instance whose engine holds it (the book knows where it is routed)
    route_to: int | None = None  # an Interrupt is in flight and a checkout to this instance follows it
    oldest_version: int | None = None  # oldest model version that generated any of its tokens
    view: PendingTrajectory | None = None  # as the strategies see it (kept by the pool)
    cut: TrajectoryFate | None = None  # why it is being aborted on its instance (length-skew accounting)

    @property
    def state(self) -> TrajState:
        return self.record.state

    @property
    def context(self) -> int:
        return len(self.group.prompt_ids) + self.generated


class TrajectoryPool:
    """A ``TrajectoryBook`` and the simulation's side of its trajectories. Every state change
    goes through the book; ``record`` (when set) is told each of them, as the events a trajectory
    server would receive (the replay test feeds them to the real one)."""

    def __init__(self, workload: WorkloadModel, batch_size: int, members: int, needed: int,
                 cancelled_fate: TrajectoryFate = TrajectoryFate.ABORTED):
        self.workload = workload
        self.batch_size = batch_size
        self.members = members
        self.needed = needed
        self.book = TrajectoryBook()
        self.trajs: dict[str, SimTrajectory] = {}
        self.sampled = 0
        self.surplus_groups = 0  # groups the ledger cancelled while live
        self.wasted_tokens = 0  # tokens of finished members of those groups
        self.record: Callable[..., None] | None = None
        self.cancelled_fate = cancelled_fate  # why the ledger cancels groups (redundancy or the bound)
        self.skew: LengthSkew | None = None  # told the fates of the trajectories the pool aborts
        self.reserved: list[str] = []  # the groups the last checkout reserved
        # what the strategies see of the book's pending trajectories, in the book's order: kept
        # from the records each transition returns, so a cycle's list is one copy
        self._pending: dict[str, PendingTrajectory] = {}

    def _show(self, t: SimTrajectory) -> None:
        """(Re)build what the strategies see of ``t`` (``length``: prompt plus what it generated
        so far) after its length or its group's V_traj changed."""
        t.view = PendingTrajectory(t.traj_id, t.group.group_id, t.group.v_traj, t.context, t.record.seq)
        if t.traj_id in self._pending:
            self._pending[t.traj_id] = t.view

    def _track(self, changed: list[TrajRecord]) -> None:
        """Follow the records a transition changed: one entering pending joins the end of the
        list (as it joins the book's), one leaving it leaves."""
        pending = self._pending
        for t in changed:
            pending.pop(t.traj_id, None)
            if t.state is TrajState.PENDING:
                pending[t.traj_id] = self.trajs[t.traj_id].view  # type: ignore[assignment]

    def _event(self, *event: object) -> None:
        if self.record is not None:
            self.record(*event)

    # ------------------------------------------------------------------ sampling

    def _naming(self, index: int) -> tuple[str, str]:
        group_id = f"s{index // self.batch_size}-g{index % self.batch_size}"
        return group_id, f"{group_id}/m"

    def sample(self, n: int) -> list[GroupRecord]:
        """``n`` new prompt groups, every member pending."""
        indices = range(self.sampled, self.sampled + n)
        self.sampled += n
        prompts = [(i, "", "", self.workload.prompt_ids(self._naming(i)[0])) for i in indices]
        groups, records = self.book.new_groups(prompts, self.members, self.needed, 0.0, self._naming)
        self.book.add(groups, records)
        by_group = {g.group_id: g for g in groups}
        for t in records:
            self.trajs[t.traj_id] = traj = SimTrajectory(t.traj_id, t, by_group[t.group_id])
            self._show(traj)
        self._track(records)
        self._event("sample", list(indices))
        return groups

    def live_groups(self) -> int:
        return self.book.live_groups()

    @property
    def occupied(self) -> int:
        """Groups occupied and not yet consumed."""
        return self.book.groups_in(GroupState.OCCUPIED)

    def unfinished_groups(self) -> bool:
        """Whether a group still waits for its members (sampled or reserved)."""
        return bool(self.book.groups_in(GroupState.SAMPLED) or self.book.groups_in(GroupState.RESERVED))

    def _forget_finished(self, group_ids: list[str]) -> None:
        finished = self.book.finished(group_ids)
        for g in finished:
            for m in g.member_ids:
                del self.trajs[m]
                self._pending.pop(m, None)
        self.book.forget(finished)

    # ------------------------------------------------------------------ the trajectory server's queue

    def pending(self) -> list[PendingTrajectory]:
        return list(self._pending.values())

    @property
    def pending_count(self) -> int:
        return len(self.book.in_state(TrajState.PENDING))

    def checkout(self, instance_id: str, assignments: list[tuple[str, int]],
                 reserve: Callable[[str, int], Transition]) -> tuple[list[SimTrajectory], int, list[SimTrajectory]]:
        """The trajectory server's checkout: reserve the new groups in the ledger (``reserve``;
        a refusal refuses their members), route what the book grants, then follow the ledger's
        transitions. Returns the routed trajectories, how many reservations the ledger refused,
        and the trajectories to abort on their instances (then ``cancelled``)."""
        if not assignments:
            return [], 0, []
        book = self.book
        not_reserved: dict[str, str] = {}
        transitions = []
        self.reserved = []
        for group_id, v_traj in book.reservations_needed(assignments).items():
            try:
                transitions.append(reserve(group_id, v_traj))
            except LedgerError as exc:
                not_reserved[group_id] = exc.message
                continue
            book.set_group_version(group_id, v_traj)
            self.reserved.append(group_id)
            for m in book.groups[group_id].member_ids:
                self._show(self.trajs[m])
        granted, _ = book.grant(assignments, not_reserved)
        self._event("checkout", instance_id, assignments)
        records = book.checkout(instance_id, granted)
        self._track(records)
        routed = [self.trajs[t.traj_id] for t in records]
        return routed, len(not_reserved), self.follow_all(transitions)

    def returned(self, instance_id: str, trajs: list[SimTrajectory]) -> None:
        """Interrupted on ``instance_id``: back to pending with what they generated (their
        ``generated`` already updated), or aborted if their group closed meanwhile."""
        for t in trajs:
            t.engine = None
            self._show(t)
        _, changed = self.book.returned([_generated(t) for t in trajs], instance_id)
        self._track(changed)
        self._event("returned", instance_id, [t.traj_id for t in trajs])
        self._forget_finished([t.group_id for t in changed if t.state is TrajState.ABORTED])

    def release(self, instance_id: str) -> int:
        """A failed instance: what was routed to it goes back to pending (cancellations due
        there end). Returns how many trajectories changed."""
        changed = self.book.release_instance(instance_id)
        for t in changed:
            self.trajs[t.traj_id].engine = None
            self._show(self.trajs[t.traj_id])
        self._track(changed)
        self._event("release", instance_id)
        self._forget_finished([t.group_id for t in changed if t.state is TrajState.ABORTED])
        return len(changed)

    def cancelled(self, trajs: list[SimTrajectory]) -> None:
        """Aborts acknowledged by their instances."""
        if not trajs:
            return
        for t in trajs:
            t.engine = None
        self.book.cancelled([t.traj_id for t in trajs])
        self._event("cancelled", [t.traj_id for t in trajs])
        self._forget_finished([t.group.group_id for t in trajs])

    def completed(self, instance_id: str, traj: SimTrajectory,
                  occupy: Callable[[str], Transition]) -> tuple[bool, bool, list[SimTrajectory]]:
        """A completion from ``instance_id``, rewarded at once; a group with enough rewarded
        members is occupied in the ledger (``occupy``) and closed, and the ledger's transitions
        are followed. Returns whether it counted (False: a surplus completion, aborted), whether
        a group was occupied, and the trajectories to abort on their instances."""
        traj.engine = None
        self._event("completed", instance_id, traj.traj_id)
        changed = self.book.completed([_generated(traj, instance_id)])
        self._track(changed)
        if not changed or changed[0].state is not TrajState.COMPLETED:
            self._forget_finished([traj.group.group_id])
            return False, False, []
        _, closable = self.book.rewarded({traj.traj_id: SIM_REWARD})
        abort: list[SimTrajectory] = []
        for g in closable:
            transition = occupy(g.group_id)
            _, closed, on_instances = self.book.close_group(g.group_id, GroupState.OCCUPIED)
            self._track(closed)
            abort += self._cutting(closed, on_instances, TrajectoryFate.DROPPED)
            abort += self.follow(transition)
        return True, bool(closable), abort

    def consume(self, consume: Callable[[], Transition]) -> tuple[Transition, list[tuple[SimTrajectory, GroupRecord]],
                                                                  list[SimTrajectory]]:
        """The trainer consumes the head buffer (``consume``; a ``LedgerError`` if it is not
        Ready) and reads its trajectories, which leave the pool. Returns the ledger's transition,
        the batch and the trajectories to abort on their instances."""
        transition = consume()
        self._event("consume")
        consumed = transition.consumed or []
        batch = [(self.trajs[t.traj_id], g) for t, g in self.book.batch(consumed)]
        abort = self.follow(transition)
        self.book.free(consumed)
        self._event("free", list(consumed))
        self._forget_finished(consumed)
        return transition, batch, abort

    def follow_all(self, transitions: list[Transition]) -> list[SimTrajectory]:
        return [t for transition in transitions for t in self.follow(transition)]

    def follow(self, transition: Transition) -> list[SimTrajectory]:
        """What a ledger transition does to the trajectory server (``follow_ledger``); counts
        the groups it cancelled and the tokens their finished members had. Returns the
        trajectories still routed to instances (to be aborted there)."""
        op = transition.op
        consumed = transition.consumed if op == "consume" else None
        if not (consumed or transition.cancelled or op == "abort"):
            return []
        done: set[str] = set()
        for group_id in transition.cancelled:
            g = self.book.groups.get(group_id)
            if g is not None and g.state in LIVE_GROUP_STATES:
                self.surplus_groups += 1
                finished = [m for m in g.member_ids
                            if self.book.trajs[m].state in (TrajState.COMPLETED, TrajState.REWARDED)]
                self.wasted_tokens += sum(self.trajs[m].generated for m in finished)
                done.update(finished)
                if self.skew is not None:
                    self.skew.settle_all(finished, self.cancelled_fate)
                    self.skew.forget_group(group_id)
        _, changed, on_instances = self.book.follow_ledger(op, transition.group_id, consumed or (),
                                                           transition.cancelled, self.cancelled_fate)
        self._track(changed)
        abort = self._cutting([t for t in changed if t.traj_id not in done], on_instances, self.cancelled_fate)
        self._forget_finished(list(transition.cancelled))
        return abort

    def _cutting(self, closed: list[TrajRecord], on_instances: list[TrajRecord], fate: TrajectoryFate) -> list[SimTrajectory]:
        """Members a closing group stopped (``fate``: why): those off any engine are told to the
        length-skew accounting now, those on one once their instance aborts them."""
        running = {t.traj_id for t in on_instances}
        if self.skew is not None:
            for t in closed:
                if t.traj_id not in running and t.state is TrajState.ABORTED:
                    self.skew.stopped(t.traj_id, self.trajs[t.traj_id].generated, fate)
        abort = [self.trajs[t.traj_id] for t in on_instances]
        for traj in abort:
            traj.cut = fate
        return abort


def _generated(t: SimTrajectory, instance_id: str | None = None) -> Generated:
    """What the book is told: no tokens (the simulation counts them beside it)."""
    return Generated(t.traj_id, (), (), (), "stop" if instance_id else None, instance_id)
