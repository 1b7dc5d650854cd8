"""The trajectory book as a state machine: hypothesis drives every transition in any order the
services could, and after each step every change is one the transition tables allow and the
book's invariants hold."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from staleflow.errors import ErrorCode
from staleflow.length_skew import Fate
from staleflow.trajectory_book import (
    GROUP_TRANSITIONS,
    TRAJ_TRANSITIONS,
    Checkpoint,
    Generated,
    GroupState,
    StoreConflict,
    TrajectoryBook,
    TrajState,
)

INSTANCES = ("i0", "i1")


def _traj_of(assignment: tuple[str, int]) -> str:
    return assignment[0]


class BookMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = TrajectoryBook()
        self.prompts = 0
        self.before: tuple[dict, dict] = ({}, {})
        self.completed_once: set[str] = set()
        self.routed_ever: set[str] = set()  # only what was routed can come back completed
        self.said: dict[str, int] = {}  # routed trajectory -> the most its instance said it holds

    # -- helpers

    def _ids(self, *states: TrajState) -> list[str]:
        return sorted(t.traj_id for t in self.book.trajs.values() if t.state in states)

    def _groups(self, *states: GroupState) -> list[str]:
        return sorted(g.group_id for g in self.book.groups.values() if g.state in states)

    def _mark(self) -> None:
        self.before = ({k: t.state for k, t in self.book.trajs.items()},
                       {k: g.state for k, g in self.book.groups.items()})

    def _grown(self, traj_id: str, by: int) -> Generated:
        """The trajectory with ``by`` more tokens, as an instance would hand it back."""
        tokens = self.book.trajs[traj_id].tokens + tuple(range(by))
        return Generated(traj_id, tokens, tuple(-1.0 for _ in tokens), ((0, 0, len(tokens)),) if tokens else ())

    # -- rules: one per transition of the service

    def _routable(self) -> list[str]:
        return [t for t in self._ids(TrajState.PENDING) if self.book.groups[self.book.trajs[t].group_id].v_traj is not None]

    @initialize(members=st.integers(1, 3), spare=st.integers(0, 2))
    def start(self, members: int, spare: int) -> None:
        self.sample(2, members, spare)

    @precondition(lambda self: self.book.live_groups() < 4)
    @rule(groups=st.integers(1, 2), members=st.integers(1, 3), spare=st.integers(0, 2))
    def sample(self, groups: int, members: int, spare: int) -> None:
        self._mark()
        prompts = [(self.prompts + i, "q", "a", (1, 2)) for i in range(groups)]
        self.prompts += groups
        new_groups, trajs = self.book.new_groups(prompts, members + spare, members, 0.0)
        self.book.add(new_groups, trajs)

    @precondition(lambda self: self._groups(GroupState.RESERVED))
    @rule(data=st.data(), v_traj=st.integers(0, 3))
    def reserve_again(self, data: st.DataObject, v_traj: int) -> None:
        """A retried reservation: the same V_traj changes nothing, another one is refused."""
        g = self.book.groups[data.draw(st.sampled_from(self._groups(GroupState.RESERVED)))]
        self._mark()
        if g.v_traj != v_traj:
            with pytest.raises(StoreConflict):
                self.book.set_group_version(g.group_id, v_traj)
        else:
            assert self.book.set_group_version(g.group_id, v_traj) == []

    @precondition(lambda self: self._ids(TrajState.PENDING))
    @rule(data=st.data(), instance=st.sampled_from(INSTANCES), v_traj=st.integers(0, 3))
    def route(self, data: st.DataObject, instance: str, v_traj: int) -> None:
        """The service's checkout: a group's first routed member fixes its V_traj, then all go."""
        picked = data.draw(st.lists(st.sampled_from(self._ids(TrajState.PENDING)), min_size=1, max_size=4, unique=True))
        self._mark()
        for traj_id in picked:
            g = self.book.groups[self.book.trajs[traj_id].group_id]
            if g.v_traj is None:
                assert self.book.set_group_version(g.group_id, v_traj) == [g] and g.state is GroupState.RESERVED
        routed = self.book.checkout(instance, picked)
        self.routed_ever.update(picked)
        assert [t.traj_id for t in routed] == picked
        assert all(t.state is TrajState.ROUTED and t.instance_id == instance for t in routed)

    @precondition(lambda self: self._ids(TrajState.PENDING, TrajState.ROUTED))
    @rule(data=st.data(), instance=st.sampled_from(INSTANCES))
    def checkout_through_the_ledger(self, data: st.DataObject, instance: str) -> None:
        """The service's checkout (and the simulation's): reserve the groups the book names,
        some refused by the ledger, then route what it grants."""
        ids = self._ids(TrajState.PENDING, TrajState.ROUTED)
        assignments = data.draw(st.lists(st.tuples(st.sampled_from(ids), st.integers(0, 3)), min_size=1, max_size=5,
                                         unique_by=_traj_of))
        self._mark()
        needed = self.book.reservations_needed(assignments)
        refused_groups = data.draw(st.sets(st.sampled_from(sorted(needed)))) if needed else set()
        for group_id, v_traj in needed.items():
            assert self.book.groups[group_id].state is GroupState.SAMPLED
            assert v_traj == next(v for t, v in assignments if self.book.trajs[t].group_id == group_id
                                  and self.book.trajs[t].state is TrajState.PENDING), "the first assignment's V_traj"
            if group_id not in refused_groups:
                self.book.set_group_version(group_id, v_traj)
        granted, refused = self.book.grant(assignments, {g: "not admissible" for g in refused_groups})
        assert sorted(granted + [t for t, _ in refused]) == sorted(t for t, _ in assignments)
        for traj_id, v_traj in assignments:
            t = self.book.trajs[traj_id]
            g = self.book.groups[t.group_id]
            ok = t.state is TrajState.PENDING and g.state is GroupState.RESERVED and g.v_traj == v_traj
            assert (traj_id in granted) == (ok and g.group_id not in refused_groups)
        self.book.checkout(instance, granted)
        self.routed_ever.update(granted)

    @precondition(lambda self: self._groups(GroupState.SAMPLED) and self._routable())
    @rule(data=st.data())
    def checkout_before_reserving(self, data: st.DataObject) -> None:
        group_id = data.draw(st.sampled_from(self._groups(GroupState.SAMPLED)))
        self._mark()
        with pytest.raises(StoreConflict):  # all or none: nothing is routed
            self.book.checkout("i0", [*self._routable()[:1], self.book.groups[group_id].member_ids[0]])

    @precondition(lambda self: self._ids(TrajState.ROUTED, TrajState.CANCELLING))
    @rule(data=st.data(), grown=st.integers(-2, 3), from_owner=st.booleans())
    def give_back(self, data: st.DataObject, grown: int, from_owner: bool) -> None:
        """An interrupt's partial (grown), or a stale copy (shorter: a failed route's payload)."""
        traj_id = data.draw(st.sampled_from(self._ids(TrajState.ROUTED, TrajState.CANCELLING)))
        t = self.book.trajs[traj_id]
        owner, tokens = t.instance_id, t.tokens
        partial = self._grown(traj_id, max(grown, 0))
        if grown < 0:
            partial = Generated(traj_id, tokens[:grown], (), ())
        self._mark()
        outcome, _ = self.book.returned([partial], owner if from_owner else None)
        assert outcome[traj_id] in ("pending", "aborted")
        assert t.tokens[: len(tokens)] == tokens  # generated tokens are never lost

    @precondition(lambda self: self._ids(TrajState.ROUTED, TrajState.CANCELLING))
    @rule(data=st.data(), back=st.integers(0, 3), grown=st.integers(1, 3), from_owner=st.booleans(),
          older_version=st.booleans())
    def checkpoint(self, data: st.DataObject, back: int, grown: int, from_owner: bool, older_version: bool) -> None:
        """A progress checkpoint: from the instance running it or another one, overlapping what is
        held or leaving a gap, with versions at or below the group's V_traj."""
        traj_id = data.draw(st.sampled_from(self._ids(TrajState.ROUTED, TrajState.CANCELLING)))
        t = self.book.trajs[traj_id]
        before, v_traj = t.tokens, self.book.groups[t.group_id].v_traj
        start = max(len(before) - back, 0) if back else len(before) + 1  # back 0: a gap of one token
        end = start + grown
        stream = before + tuple(range(100, 100 + end))  # what the instance holds: the book's part, then new
        version = v_traj - 1 if older_version and v_traj else v_traj
        owner = t.instance_id if from_owner else next(i for i in INSTANCES if i != t.instance_id)
        self._mark()
        held, appended = self.book.checkpoint([Checkpoint(traj_id, owner, start, stream[start:end],
                                                          tuple(-1.0 for _ in range(start, end)),
                                                          ((version, 0, end),))])
        counts = (t.state is TrajState.ROUTED and from_owner and back > 0 and version == v_traj)
        assert (traj_id in held) == counts
        assert t.tokens[: len(before)] == before  # generated tokens are never lost
        assert len(t.tokens) == (max(end, len(before)) if counts else len(before))
        assert [c.start for c in appended] == ([len(before)] if counts and end > len(before) else [])

    @precondition(lambda self: self._ids(TrajState.ROUTED, TrajState.CANCELLING))
    @rule(data=st.data(), ahead=st.integers(0, 5), from_owner=st.booleans())
    def instance_says_what_it_holds(self, data: st.DataObject, ahead: int, from_owner: bool) -> None:
        """A checkpoint batch's ``held``: how far a trajectory got on its instance (or a stray word)."""
        traj_id = data.draw(st.sampled_from(self._ids(TrajState.ROUTED, TrajState.CANCELLING)))
        t = self.book.trajs[traj_id]
        owner = t.instance_id if from_owner else next(i for i in INSTANCES if i != t.instance_id)
        self._mark()
        self.book.holding(owner, {traj_id: len(t.tokens) + ahead})
        if from_owner and t.state is TrajState.ROUTED:
            self.said[traj_id] = max(self.said.get(traj_id, 0), len(t.tokens) + ahead)

    @precondition(lambda self: self._ids(TrajState.ROUTED, TrajState.CANCELLING))
    @rule(instance=st.sampled_from(INSTANCES))
    def instance_fails(self, instance: str) -> None:
        self._mark()
        lost = sum(max(self.said.get(t.traj_id, 0) - len(t.tokens), 0) for t in self.book.trajs.values()
                   if t.state is TrajState.ROUTED and t.instance_id == instance)
        before = self.book.regenerated[1]
        self.book.release_instance(instance)
        assert self.book.regenerated[1] == before + lost, "what it held beyond the book is regenerated"
        assert self.book.regenerated[1] == self.book.skew.totals().regenerated_tokens.total()
        assert not any(t.instance_id == instance for t in self.book.trajs.values()
                       if t.state in (TrajState.ROUTED, TrajState.CANCELLING))

    def _finishable(self) -> list[str]:
        return [t for t in self._ids(TrajState.ROUTED, TrajState.CANCELLING, TrajState.PENDING) if t in self.routed_ever]

    @precondition(lambda self: self._finishable())
    @rule(data=st.data(), grown=st.integers(1, 3))
    def complete(self, data: st.DataObject, grown: int) -> None:
        picked = data.draw(st.lists(st.sampled_from(self._finishable()), min_size=1, max_size=4, unique=True))
        self._mark()
        items = [self._grown(t, grown) for t in picked]
        changed = self.book.completed([Generated(p.traj_id, p.tokens, p.logprobs, p.segments, "stop",
                                                 self.book.trajs[p.traj_id].instance_id or "i0") for p in items])
        assert {t.traj_id for t in changed} == set(picked)
        for t in changed:
            if t.state is TrajState.COMPLETED:
                assert t.traj_id not in self.completed_once  # a trajectory completes at most once
                self.completed_once.add(t.traj_id)

    @precondition(lambda self: self.completed_once)
    @rule(data=st.data())
    def completion_redelivered(self, data: st.DataObject) -> None:
        traj_id = data.draw(st.sampled_from(sorted(self.completed_once)))
        self._mark()
        if traj_id not in self.book.trajs:  # its group finished and left the book
            assert self.book.completed([Generated(traj_id, (1,), (-1.0,))]) == []
        elif self.book.trajs[traj_id].state is not TrajState.PENDING:  # (pending: released, then finished again)
            assert self.book.completed([self._grown(traj_id, 1)]) == []

    @precondition(lambda self: self._ids(TrajState.COMPLETED))
    @rule(data=st.data(), reward=st.sampled_from([0.0, 1.0]))
    def reward(self, data: st.DataObject, reward: float) -> None:
        picked = data.draw(st.lists(st.sampled_from(self._ids(TrajState.COMPLETED)), min_size=1, unique=True))
        self._mark()
        changed, ready = self.book.rewarded({t: (reward, "correct" if reward else "wrong_answer") for t in picked})
        assert {t.traj_id for t in changed} == set(picked)
        assert all(len(self.book.group_rewarded(g)) >= g.needed for g in ready)

    @precondition(lambda self: self.book.closable_groups())
    @rule(data=st.data())
    def occupy(self, data: st.DataObject) -> None:
        g = data.draw(st.sampled_from(self.book.closable_groups()))
        self._mark()
        _, _, on_instances = self.book.close_group(g.group_id, GroupState.OCCUPIED)
        assert all(t.state is TrajState.CANCELLING for t in on_instances)

    @precondition(lambda self: self.book.live_groups() >= 3)  # now and then, not before any group could finish
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """The ledger aborted the group (surplus, a filter, a dead rollout)."""
        group_id = data.draw(st.sampled_from(self._groups(GroupState.SAMPLED, GroupState.RESERVED, GroupState.OCCUPIED)))
        self._mark()
        self.book.close_group(group_id, GroupState.ABORTED)
        members = [self.book.trajs[m] for m in self.book.groups[group_id].member_ids]
        assert all(t.state in (TrajState.ABORTED, TrajState.CANCELLING, TrajState.CONSUMED) for t in members)

    @precondition(lambda self: self.book.cancellations())
    @rule(data=st.data())
    def abort_acknowledged(self, data: st.DataObject) -> None:
        picked = data.draw(st.lists(st.sampled_from(sorted(t.traj_id for t in self.book.cancellations())),
                                    min_size=1, unique=True))
        self._mark()
        self.book.cancelled(picked)
        assert all(self.book.trajs[t].state is TrajState.ABORTED for t in picked)

    @precondition(lambda self: self._groups(GroupState.OCCUPIED))
    @rule(data=st.data(), staleness=st.integers(0, 2))
    def trainer_consumes(self, data: st.DataObject, staleness: int) -> None:
        group_id = data.draw(st.sampled_from(self._groups(GroupState.OCCUPIED)))
        needed = self.book.groups[group_id].needed
        self._mark()
        trained = self.book.skew.totals().fates[Fate.TRAINED].total()
        self.book.mark_consumed([group_id], self.book.groups[group_id].v_traj + staleness)
        assert self.book.skew.totals().fates[Fate.TRAINED].total() == trained + needed
        batch = self.book.batch([group_id])
        assert len(batch) == needed and all(t.state is TrajState.REWARDED for t, _ in batch)
        self.book.free([group_id])
        assert all(t.state is TrajState.CONSUMED and not t.tokens for t, _ in batch)
        with pytest.raises(StoreConflict) as freed:  # a freed batch is refused, never handed out empty
            self.book.batch([group_id])
        assert freed.value.code is ErrorCode.BATCH_FREED

    @rule()
    def finished_groups_leave(self) -> None:
        finished = self.book.finished(list(self.book.groups))
        for g in finished:
            assert g.state in (GroupState.CONSUMED, GroupState.ABORTED)
            assert {self.book.trajs[m].state for m in g.member_ids} <= {TrajState.CONSUMED, TrajState.ABORTED}
        unfinished = [g for g in self.book.groups.values() if g not in finished]
        assert all(g.state in (GroupState.SAMPLED, GroupState.RESERVED, GroupState.OCCUPIED) or any(
            self.book.trajs[m].state not in (TrajState.CONSUMED, TrajState.ABORTED) for m in g.member_ids)
            for g in unfinished)  # nothing that will still change leaves
        self._mark()
        self.book.forget(finished)
        for g in finished:
            assert g.group_id not in self.book.groups
            assert not set(g.member_ids) & set(self.book.trajs)
            assert self.book.completed([Generated(g.member_ids[0])]) == []  # a late redelivery changes nothing
            assert self.book.returned([Generated(g.member_ids[0])], None)[0] == {g.member_ids[0]: "unknown"}

    # -- what must hold after every step

    @invariant()
    def only_allowed_transitions(self) -> None:
        trajs, groups = self.before
        for key, was in trajs.items():
            if key not in self.book.trajs:  # finished: left the book
                continue
            now = self.book.trajs[key].state
            assert was is now or (was, now) in TRAJ_TRANSITIONS, f"{key}: {was} -> {now}"
        for key, was in groups.items():
            if key not in self.book.groups:
                continue
            now = self.book.groups[key].state
            assert was is now or (was, now) in GROUP_TRANSITIONS, f"{key}: {was} -> {now}"

    @invariant()
    def where_each_trajectory_is(self) -> None:
        for t in self.book.trajs.values():
            if t.state in (TrajState.ROUTED, TrajState.CANCELLING):
                assert t.instance_id is not None
            if t.state is TrajState.PENDING:
                assert t.instance_id is None
            g = self.book.groups[t.group_id]
            if t.state is not TrajState.PENDING and t.state is not TrajState.ABORTED:
                assert g.v_traj is not None  # nothing runs, completes or trains without its V_traj
            if t.state in (TrajState.COMPLETED, TrajState.REWARDED):
                assert g.state in (GroupState.RESERVED, GroupState.OCCUPIED)

    @invariant()
    def a_group_trains_exactly_its_batch_share(self) -> None:
        for g in self.book.groups.values():
            states = [self.book.trajs[m].state for m in g.member_ids]
            if g.state is GroupState.OCCUPIED:
                assert states.count(TrajState.REWARDED) == g.needed
            if g.state is GroupState.CONSUMED:
                assert states.count(TrajState.CONSUMED) == g.needed
            if g.state is GroupState.SAMPLED:
                assert set(states) <= {TrajState.PENDING}

    @invariant()
    def versions_cover_every_held_token(self) -> None:
        for t in self.book.trajs.values():
            if t.state in (TrajState.PENDING, TrajState.ROUTED):
                assert len(t.logprobs) == len(t.tokens) == (t.segments[-1][2] if t.segments else 0)

    @invariant()
    def a_word_on_progress_lasts_while_the_trajectory_stays_routed(self) -> None:
        """(The model's side: the book forgets it when the trajectory leaves its instance.)"""
        for traj_id in [t for t in self.said if t not in self.book.trajs
                        or self.book.trajs[t].state is not TrajState.ROUTED]:
            del self.said[traj_id]

    @invariant()
    def the_length_skew_accounts_for_every_generated_trajectory(self) -> None:
        skew = self.book.skew
        total, in_flight = skew.totals(), skew.in_flight()
        for bucket in set(total.generated) | set(in_flight):
            assert total.generated[bucket] == sum(total.fates[f][bucket] for f in Fate) + in_flight[bucket]
        for traj_id in skew._open:  # generated, fate unknown: finished and waiting for training
            t = self.book.trajs.get(traj_id)
            assert t is not None and t.state in (TrajState.COMPLETED, TrajState.REWARDED), traj_id
        assert all(self.book.trajs[t].state is TrajState.CANCELLING for t in skew._cutting)

    @invariant()
    def counts_cover_every_trajectory(self) -> None:
        assert sum(self.book.counts().values()) == len(self.book.trajs)

    @invariant()
    def the_indexes_answer_as_a_full_scan_would(self) -> None:
        by_seq = sorted(self.book.trajs.values(), key=lambda t: t.seq)
        assert [t for t, _ in self.book.pending()] == [t for t in by_seq if t.state is TrajState.PENDING]
        on_instances = [t for t in by_seq if t.state in (TrajState.ROUTED, TrajState.CANCELLING)]
        assert [t for t, _ in self.book.routed()] == on_instances
        for instance in {t.instance_id for t in on_instances}:
            assert [t for t, _ in self.book.routed(instance)] == [t for t in on_instances if t.instance_id == instance]
        assert self.book.cancellations() == [t for t in by_seq if t.state is TrajState.CANCELLING]
        assert self.book.versioned_pending() == sum(
            t.state is TrajState.PENDING and self.book.groups[t.group_id].v_traj is not None for t in by_seq)
        for state in TrajState:
            assert set(self.book.in_state(state)) == {t.traj_id for t in by_seq if t.state is state}
        for state in GroupState:
            assert self.book.groups_in(state) == sum(g.state is state for g in self.book.groups.values())
        assert self.book.live_groups() == len(self._groups(GroupState.SAMPLED, GroupState.RESERVED, GroupState.OCCUPIED))
        assert self.book.completed_ones() == [t for t in by_seq if t.state is TrajState.COMPLETED]


BookMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_trajectory_book = BookMachine.TestCase


def test_stored_checkpoints_are_adopted_in_order_and_only_where_they_continue_the_response() -> None:
    book = TrajectoryBook()
    groups, trajs = book.new_groups([(0, "q", "a", (1, 2))], 1, 1, 0.0)
    book.add(groups, trajs)
    book.set_group_version("g0", 0)
    book.checkout("i0", ["g0-m0"])
    t = book.trajs["g0-m0"]

    def part(start: int, tokens: tuple[int, ...]) -> Checkpoint:
        end = start + len(tokens)
        return Checkpoint("g0-m0", "i0", start, tokens, tuple(-0.5 for _ in tokens), ((0, 0, end),))

    assert book.adopt(part(0, (7, 8))) and t.tokens == (7, 8)
    assert not book.adopt(part(3, (9,))), "a gap: not adopted"
    assert not book.adopt(part(0, (7,))), "nothing new"
    assert book.adopt(part(1, (8, 9))) and t.tokens == (7, 8, 9) and t.segments == ((0, 0, 3),)
