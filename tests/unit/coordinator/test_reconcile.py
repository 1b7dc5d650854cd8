"""Reconciliation between the trajectory server and the instances: the pure rule, then a driven
simulation whose messages are dropped, duplicated and reordered, over the real trajectory state
machine (``TrajectoryBook``) and the real rule (``reconcile``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staleflow.coordinator.reconcile import Mismatch, reconcile
from staleflow.trajectory_book import Generated, GroupState, TrajectoryBook, TrajState

GRACE = 2.5


def test_routed_but_not_held_is_handed_back_only_after_the_grace_period() -> None:
    routed = {"t1": "a", "t2": "a"}
    first = reconcile(0.0, GRACE, routed, {"a": frozenset({"t2"})}, {})
    assert first.empty and set(first.suspects) == {(Mismatch.MISSING, "t1", "a")}
    still = reconcile(2.0, GRACE, routed, {"a": frozenset({"t2"})}, first.suspects)
    assert still.empty
    due = reconcile(3.0, GRACE, routed, {"a": frozenset({"t2"})}, still.suspects)
    assert due.hand_back == {"a": ["t1"]} and not due.abort and not due.suspects


def test_a_snapshot_that_shows_it_again_clears_the_suspicion() -> None:
    routed = {"t1": "a"}
    first = reconcile(0.0, GRACE, routed, {"a": frozenset()}, {})
    seen = reconcile(1.0, GRACE, routed, {"a": frozenset({"t1"})}, first.suspects)
    assert not seen.suspects
    again = reconcile(3.0, GRACE, routed, {"a": frozenset()}, seen.suspects)
    assert again.empty, "the grace period starts over"


def test_no_settled_snapshot_keeps_a_suspicion_but_never_acts_on_it() -> None:
    routed = {"t1": "a"}
    first = reconcile(0.0, GRACE, routed, {"a": frozenset()}, {})
    unknown = reconcile(10.0, GRACE, routed, {"a": None}, first.suspects)
    assert unknown.empty and unknown.suspects == first.suspects
    confirmed = reconcile(11.0, GRACE, routed, {"a": frozenset()}, unknown.suspects)
    assert confirmed.hand_back == {"a": ["t1"]}
    # a trajectory no longer routed there is no longer suspected, looked at or not
    gone = reconcile(10.0, GRACE, {}, {"a": None}, first.suspects)
    assert not gone.suspects


def test_held_without_being_routed_there_is_aborted_after_the_grace_period() -> None:
    routed = {"t1": "b"}  # the trajectory server has it on b; a runs a stray copy, and one it never heard of
    held = {"a": frozenset({"t1", "x"}), "b": frozenset({"t1"})}
    first = reconcile(0.0, GRACE, routed, held, {})
    assert first.empty
    due = reconcile(3.0, GRACE, routed, held, first.suspects)
    assert not due.hand_back and {i: sorted(t) for i, t in due.abort.items()} == {"a": ["t1", "x"]}


def test_routed_to_an_unknown_instance_is_handed_back() -> None:
    first = reconcile(0.0, GRACE, {"t1": "gone"}, {"a": frozenset()}, {})
    due = reconcile(3.0, GRACE, {"t1": "gone"}, {"a": frozenset()}, first.suspects)
    assert due.hand_back == {"gone": ["t1"]}


def test_an_abort_reported_by_an_instance_ends_only_a_cancellation() -> None:
    book = TrajectoryBook()
    groups, trajs = book.new_groups([(0, "p", "a", (1, 2))], members=3, needed=2, now=0.0)
    book.add(groups, trajs)
    book.set_group_version("g0", 0)
    book.checkout("a", ["g0-m0", "g0-m1"])
    aborted = [Generated(t, (5,), (-1.0,), ((0, 0, 1),), "abort", "a") for t in ("g0-m0", "g0-m2")]
    assert book.completed(aborted) == []  # routed there, or pending: an abort is no completion
    assert [book.trajs[t].state for t in ("g0-m0", "g0-m2")] == [TrajState.ROUTED, TrajState.PENDING]
    book.close_group("g0", GroupState.ABORTED)  # its routed members are now being cancelled
    assert book.trajs["g0-m1"].state is TrajState.CANCELLING
    (ended,) = book.completed([Generated("g0-m1", (), (), (), "abort", "a")])
    assert ended.state is TrajState.ABORTED


# ------------------------------------------------------------------------------ driven simulation


@dataclass
class Message:
    to: str  # "ts" or an instance id
    kind: str  # route / abort (to an instance), completed / return (to the trajectory server)
    body: tuple
    command_id: int | None = None  # commands: the coordinator hears of their fate (answer or timeout)


@dataclass
class Instance:
    running: dict[str, int] = field(default_factory=dict)  # traj id -> steps left
    applied: set[int] = field(default_factory=set)  # command ids, for idempotent replay


@dataclass
class World:
    book: TrajectoryBook
    instances: dict[str, Instance]
    network: list[Message] = field(default_factory=list)
    in_flight: dict[str, set[int]] = field(default_factory=dict)  # instance -> commands without an answer
    suspects: dict = field(default_factory=dict)
    now: float = 0.0
    completions: dict[str, int] = field(default_factory=dict)  # traj id -> times the TS took it as completed
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def send(self, message: Message) -> None:
        if message.command_id is not None:
            self.in_flight.setdefault(message.to, set()).add(message.command_id)
        self.network.append(message)

    def settle(self, message: Message) -> None:
        if message.command_id is not None:
            self.in_flight.get(message.to, set()).discard(message.command_id)

    def deliver(self, message: Message) -> None:
        if message.to == "ts":
            kind, items = message.kind, message.body
            if kind == "completed":
                for t in self.book.completed([Generated(traj_id, (1,), (-1.0,), ((0, 0, 1),), reason, instance)
                                              for traj_id, instance, reason in items]):
                    if t.state is TrajState.COMPLETED:
                        self.completions[t.traj_id] = self.completions.get(t.traj_id, 0) + 1
            else:
                instance, traj_ids = items
                self.book.returned([Generated(t) for t in traj_ids], instance)
            return
        instance = self.instances[message.to]
        if message.command_id in instance.applied:
            return  # a retried command: replayed, not applied again
        instance.applied.add(message.command_id)
        if message.kind == "route":
            for traj_id, steps in message.body:
                instance.running.setdefault(traj_id, steps)
        else:
            stopped = [t for t in message.body if instance.running.pop(t, None) is not None]
            if stopped:
                self.network.append(Message("ts", "completed", tuple((t, message.to, "abort") for t in stopped)))

    def progress(self, instance_id: str) -> None:
        instance = self.instances[instance_id]
        finished = []
        for traj_id in list(instance.running):
            instance.running[traj_id] -= 1
            if instance.running[traj_id] <= 0:
                del instance.running[traj_id]
                finished.append(traj_id)
        if finished:
            self.network.append(Message("ts", "completed", tuple((t, instance_id, "stop") for t in finished)))

    def cycle(self, lost_snapshots: set[str], steps: int) -> None:
        """One coordinator cycle: snapshots (some lost), the reconciliation, then routing."""
        held = {i: None if i in lost_snapshots or self.in_flight.get(i) else frozenset(inst.running)
                for i, inst in self.instances.items()}
        routed = {t.traj_id: t.instance_id for t, _ in self.book.routed()}
        outcome = reconcile(self.now, GRACE, routed, held, self.suspects)
        self.suspects = outcome.suspects
        for instance_id, traj_ids in outcome.hand_back.items():
            self.send(Message("ts", "return", (instance_id, tuple(traj_ids))))
        for instance_id, traj_ids in outcome.abort.items():
            self.send(Message(instance_id, "abort", tuple(traj_ids), next(self.ids)))
        if not outcome.empty:
            return
        pending = [t.traj_id for t, _ in self.book.pending()]
        names = sorted(self.instances)
        for k, instance_id in enumerate(names):
            share = pending[k::len(names)][:2]
            if share and not self.in_flight.get(instance_id):
                self.book.checkout(instance_id, share)
                self.send(Message(instance_id, "route", tuple((t, steps) for t in share), next(self.ids)))


ACTIONS = st.one_of(
    st.tuples(st.just("deliver"), st.integers(0, 50)),
    st.tuples(st.just("drop"), st.integers(0, 50)),
    st.tuples(st.just("duplicate"), st.integers(0, 50)),
    st.tuples(st.just("progress"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("cycle"), st.frozensets(st.sampled_from(["a", "b"]))),
    st.tuples(st.just("tick"), st.floats(0.1, 3.0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(ACTIONS, max_size=120), steps=st.integers(1, 3), trajectories=st.integers(1, 6))
def test_lost_duplicated_and_reordered_messages_never_stall_the_job_or_count_twice(
        actions: list, steps: int, trajectories: int) -> None:
    book = TrajectoryBook()
    groups, trajs = book.new_groups([(0, "p", "a", (1, 2))], members=trajectories, needed=trajectories, now=0.0)
    book.add(groups, trajs)
    book.set_group_version("g0", 0)
    world = World(book, {"a": Instance(), "b": Instance()})

    for action, arg in actions:  # the adversary: any message may be lost, repeated or overtaken
        if action in ("deliver", "drop", "duplicate") and world.network:
            message = world.network[arg % len(world.network)]
            if action == "duplicate":
                world.network.append(Message(message.to, message.kind, message.body, message.command_id))
                continue
            world.network.remove(message)
            if action == "deliver":
                world.deliver(message)
            world.settle(message)  # answered, or timed out: either way the coordinator hears
        elif action == "progress":
            world.progress(arg)
        elif action == "cycle":
            world.cycle(set(arg), steps)
        elif action == "tick":
            world.now += arg

    for _ in range(200):  # then a fair network: everything is delivered, in order
        while world.network:
            message = world.network.pop(0)
            world.deliver(message)
            world.settle(message)
        if all(t.state is TrajState.COMPLETED for t in book.trajs.values()):
            break
        world.cycle(set(), steps)
        for instance_id in world.instances:
            world.progress(instance_id)
        world.now += 1.0
    states = {t.traj_id: t.state for t in book.trajs.values()}
    assert all(s is TrajState.COMPLETED for s in states.values()), f"the job stalled: {states}"
    assert set(world.completions) == set(states) and set(world.completions.values()) == {1}, world.completions
