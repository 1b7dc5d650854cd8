"""Why a buffer is not consumable yet: the pure explanation over hand-built views of the ledger,
the trajectory server and the instances."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import run_ledger_ops

from staleflow.buffer_explain import InstanceSeen, TrajectorySeen, explain_buffer, explain_consumed
from staleflow.config.manager import LedgerParams
from staleflow.cost_model import CostModel
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.ledger import EntryStatus, Ledger, LedgerError

STEP = CostModel(k1=0.0, k2=0.01, k3=0.0, k4=0.0)  # every decode step takes 10 ms, whatever the load
MAX_TOKENS = 100


def ledger(eta: int, batch: int, reserved: list[str], occupied: list[str] = (), **params: float) -> Ledger:
    led = Ledger(LedgerParams(eta=eta, batch_size=batch, **params))
    for g in reserved:
        led.reserve(g, led.train_version)
    for g in occupied:
        led.occupy(g)
    return led


def explain(led: Ledger, version: int, trajectories: list[TrajectorySeen], instances: list[InstanceSeen],
            group_size: int = 2, max_tokens: int | None = MAX_TOKENS):
    return explain_buffer(version, led.train_version, led.params.batch_size, group_size, led.buffers(), trajectories,
                          {i.instance_id: i for i in instances}, max_tokens)


def routed(traj_id: str, instance: str, generated: int = 0) -> TrajectorySeen:
    return TrajectorySeen(traj_id, traj_id.rsplit("-", 1)[0], "routed", generated, instance)


def test_the_head_waits_for_the_first_group_reserved_later_and_says_where_its_members_run() -> None:
    # eta 1, B 2: g0 occupied in buffer 0; g1, g2 reserved, placed in buffer 1
    led = ledger(1, 2, ["g0", "g1", "g2"], ["g0"])
    trajs = [routed("g1-m0", "a", 10), routed("g1-m1", "a", 30),
             TrajectorySeen("g2-m0", "g2", "pending", 0), routed("g2-m1", "b", 5)]
    a = InstanceSeen("a", "live", running=frozenset({"g1-m0", "g1-m1"}), cost=STEP)
    b = InstanceSeen("b", "live", running=frozenset({"g2-m1"}), cost=STEP)
    answer = explain(led, 0, trajs, [a, b])
    assert (answer.state, answer.consumable, answer.occupied, answer.empty, answer.needed) == ("waiting", False, 1, 1, 1)
    assert answer.unreserved == 0 and answer.consume_first == ()
    (first,) = answer.groups  # g2 has no estimate: g1 is expected to fill the slot first
    assert (first.group_id, first.buffer, first.required) == ("g1", 1, False)
    assert [(t.traj_id, t.instance_id, t.generated, t.where) for t in first.trajectories] == [
        ("g1-m0", "a", 10, "running on a"), ("g1-m1", "a", 30, "running on a")]
    # both members needed: the slower one (90 tokens left at 10 ms) decides
    assert first.ready_in_s == pytest.approx(0.9)
    assert answer.ready_in_s == pytest.approx(0.9), "one group fills the slot: the earliest one"
    assert "1 more occupied group" in answer.summary and "0.9 s" in answer.summary


def test_what_the_instance_holds_now_counts_over_the_last_checkpoint() -> None:
    led = ledger(1, 2, ["g0", "g1"], ["g0"])
    trajs = [routed("g1-m0", "a", 10), routed("g1-m1", "a", 30)]
    a = InstanceSeen("a", "live", running=frozenset({"g1-m0", "g1-m1"}), cost=STEP, held={"g1-m0": 60, "g1-m1": 30})
    (group,) = explain(led, 0, trajs, [a]).groups
    assert [t.generated for t in group.trajectories] == [60, 30]
    assert group.ready_in_s == pytest.approx(0.7)


def test_a_queued_trajectory_starts_when_the_first_running_one_there_finishes() -> None:
    led = ledger(0, 1, ["g0"])
    trajs = [routed("g0-m0", "a", 80), routed("g0-m1", "a", 0)]
    a = InstanceSeen("a", "live", running=frozenset({"g0-m0"}), waiting=frozenset({"g0-m1"}), cost=STEP)
    answer = explain(led, 0, trajs, [a])
    (group,) = answer.groups
    assert group.required, "eta 0: the group is reserved in the head and must be occupied itself"
    assert [t.where for t in group.trajectories] == ["running on a", "queued on a"]
    assert [t.ready_in_s for t in group.trajectories] == [pytest.approx(0.2), pytest.approx(0.2 + 1.0)]
    assert answer.ready_in_s == pytest.approx(1.2)


def test_a_running_step_costs_what_the_cost_model_says_for_the_instances_load() -> None:
    cost = CostModel()  # the paper's coefficients: the step time grows with the KV cache and the running set
    led = ledger(0, 1, ["g0"])
    a = InstanceSeen("a", "live", running=frozenset({"g0-m0", "x"}), kv_cache=5000.0, cost=cost)
    answer = explain(led, 0, [routed("g0-m0", "a", 40)], [a], group_size=1)
    assert answer.ready_in_s == pytest.approx(cost.decode_time(5000.0, 2, MAX_TOKENS - 40))


def test_required_groups_without_an_estimate_say_why_and_give_no_time() -> None:
    led = ledger(0, 2, ["g0", "g1"])
    trajs = [routed("g0-m0", "a", 0), routed("g0-m1", "a", 0),
             TrajectorySeen("g1-m0", "g1", "pending", 0), routed("g1-m1", "dead", 0)]
    a = InstanceSeen("a", "live", running=frozenset({"g0-m0", "g0-m1"}), cost=STEP)
    dead = InstanceSeen("dead", "failed", cost=STEP)
    answer = explain(led, 0, trajs, [a, dead])
    assert answer.state == "stuck" and answer.needed == 2
    assert [g.required for g in answer.groups] == [True, True]
    g0, g1 = answer.groups
    assert g0.ready_in_s == pytest.approx(1.0)
    assert g1.ready_in_s is None and "failed" in g1.trajectories[1].where
    assert answer.ready_in_s is None and "g1" in answer.estimate and "cannot estimate" in answer.estimate
    assert "cannot estimate" in answer.summary


def test_a_group_whose_window_ends_in_the_buffer_must_be_occupied_and_later_ones_are_left_out() -> None:
    led = ledger(1, 1, ["s0"], ["s0"])
    led.consume()
    led.reserve("g1", 0)  # its window ends at buffer 1, the head now
    led.reserve("g2", 1)
    trajs = [routed("g1-m0", "a"), routed("g2-m0", "a")]
    answer = explain(led, 1, trajs, [InstanceSeen("a", "live", running=frozenset({"g1-m0", "g2-m0"}), cost=STEP)],
                     group_size=1)
    assert [(g.group_id, g.required) for g in answer.groups] == [("g1", True)], "g2 cannot take its place"
    assert answer.ready_in_s == pytest.approx(1.0)


def test_of_groups_that_could_fill_the_buffer_the_first_expected_to_finish_is_named() -> None:
    led = ledger(1, 1, ["g0", "g1"])  # the ledger places g1 in buffer 0, g0 in buffer 1; either can fill buffer 0
    trajs = [routed("g0-m0", "a", 90), routed("g1-m0", "a")]
    answer = explain(led, 0, trajs, [InstanceSeen("a", "live", running=frozenset({"g0-m0", "g1-m0"}), cost=STEP)],
                     group_size=1)
    assert [(g.group_id, g.buffer, g.required) for g in answer.groups] == [("g0", 1, False)]
    assert answer.needed == 1 and answer.ready_in_s == pytest.approx(0.1), "the first to finish fills it"


def test_slots_no_live_group_can_fill_wait_for_new_reservations() -> None:
    led = ledger(1, 3, ["g0", "g1"], ["g0"])
    answer = explain(led, 0, [routed("g1-m0", "a", 0), routed("g1-m1", "a", 0)],
                     [InstanceSeen("a", "live", running=frozenset({"g1-m0", "g1-m1"}), cost=STEP)])
    assert answer.needed == 2 and answer.unreserved == 1
    assert answer.ready_in_s is None and "not reserved yet" in answer.estimate
    assert "1 group not reserved yet" in answer.summary


def test_a_ready_head_is_consumable() -> None:
    led = ledger(1, 2, ["g0", "g1"], ["g0", "g1"])
    answer = explain(led, 0, [], [])
    assert answer.consumable and answer.state == "ready" and answer.needed == 0 and answer.ready_in_s == 0.0
    assert "can consume it now" in answer.summary


def test_a_later_buffer_counts_the_buffers_before_it() -> None:
    # eta 1, B 1: g0 occupied fills buffer 0; g1 reserved sits in buffer 1
    led = ledger(1, 1, ["g0", "g1"], ["g0"])
    a = InstanceSeen("a", "live", running=frozenset({"g1-m0"}), cost=STEP)
    answer = explain(led, 1, [routed("g1-m0", "a", 50)], [a], group_size=1)
    assert answer.consume_first == (0,) and not answer.consumable
    assert answer.needed == 1 and [g.group_id for g in answer.groups] == ["g1"] and answer.groups[0].required
    assert answer.ready_in_s == pytest.approx(0.5) and "buffer 0 must be consumed first" in answer.estimate
    full = ledger(1, 1, ["g0", "g1"], ["g0", "g1"])
    later = explain(full, 1, [], [])
    assert later.needed == 0 and not later.consumable and "consumes buffer 0 first" in later.summary


def test_with_batch_redundancy_the_first_group_to_finish_may_fill_the_head() -> None:
    # B 2, capacity 3: g0 occupied; g1, g2 reserved; either is enough
    led = ledger(0, 2, ["g0", "g1", "g2"], ["g0"], batch_redundancy=0.5)
    trajs = [routed("g1-m0", "a", 0), routed("g2-m0", "a", 90)]
    a = InstanceSeen("a", "live", running=frozenset({"g1-m0", "g2-m0"}), cost=STEP)
    answer = explain(led, 0, trajs, [a], group_size=1)
    assert answer.needed == 1 and not any(g.required for g in answer.groups)
    assert [g.group_id for g in answer.groups] == ["g2"], "the expected-earliest"
    assert answer.ready_in_s == pytest.approx(0.1)


def test_with_batch_redundancy_groups_pinned_in_the_head_come_before_a_faster_later_one() -> None:
    # eta 1, B 1, capacity 2, trainer at 1: g4 and g6 can only train in buffer 1 and fill it, so g7
    # (window to buffer 2) cannot move in however early it finishes: one of g4, g6 must be occupied
    led = Ledger(LedgerParams(eta=1, batch_size=1, batch_redundancy=1.0))
    led.reserve("s", 0)
    led.occupy("s")
    led.consume()
    for g, v in (("g4", 0), ("g6", 0), ("g7", 1)):
        led.reserve(g, v)
    trajs = [routed("g4-m0", "a", 0), routed("g6-m0", "a", 50), routed("g7-m0", "a", 99)]
    a = InstanceSeen("a", "live", running=frozenset({"g4-m0", "g6-m0", "g7-m0"}), cost=STEP)
    answer = explain(led, 1, trajs, [a], group_size=1)
    assert [g.group_id for g in answer.groups] == ["g6"], "g7 cannot take the slot: it is not what it waits for"
    assert answer.ready_in_s == pytest.approx(0.5)


def test_a_group_whose_members_completed_waits_only_for_its_rewards() -> None:
    led = ledger(0, 1, ["g0"])
    trajs = [TrajectorySeen("g0-m0", "g0", "completed", 100, "a"), TrajectorySeen("g0-m1", "g0", "rewarded", 12, "a")]
    answer = explain(led, 0, trajs, [InstanceSeen("a", "live", cost=STEP)])
    assert answer.groups[0].ready_in_s == 0.0 and "rewards" in answer.groups[0].note
    assert answer.ready_in_s == 0.0


def test_without_max_tokens_there_is_no_estimate_and_the_answer_says_so() -> None:
    led = ledger(0, 1, ["g0"])
    a = InstanceSeen("a", "live", running=frozenset({"g0-m0"}), cost=STEP)
    answer = explain(led, 0, [routed("g0-m0", "a", 3)], [a], group_size=1, max_tokens=None)
    assert answer.ready_in_s is None and "max_tokens is unknown" in answer.estimate


def test_an_instance_pulling_weights_is_named_as_such() -> None:
    led = ledger(0, 1, ["g0"])
    a = InstanceSeen("a", "syncing", running=frozenset({"g0-m0"}), cost=STEP)
    (traj,) = explain(led, 0, [routed("g0-m0", "a", 50)], [a], group_size=1).groups[0].trajectories
    assert traj.where.startswith("running on a (pulling new weights") and traj.ready_in_s == pytest.approx(0.5)


def test_routed_but_not_on_the_instance_yet_has_no_estimate() -> None:
    led = ledger(0, 1, ["g0"])
    answer = explain(led, 0, [routed("g0-m0", "a")], [InstanceSeen("a", "live", cost=STEP)], group_size=1)
    assert "not in its last snapshot yet" in answer.groups[0].trajectories[0].where and answer.ready_in_s is None


def test_an_unknown_buffer_is_refused_with_its_code_and_a_consumed_one_says_so() -> None:
    led = ledger(1, 1, [])
    with pytest.raises(StaleFlowError) as refused:
        explain(led, 2, [], [])
    assert refused.value.code is ErrorCode.UNKNOWN_BUFFER and refused.value.status == 404
    consumed = explain_consumed(0, 3, 2, ["a", "b"])
    assert consumed.state == "consumed" and not consumed.consumable and consumed.summary == (
        "buffer 0 was already consumed: the trainer trained on its 2 groups and is now at version 3, waiting for "
        "buffer 3")
    assert "its 1 group and" in explain_consumed(0, 1, 1, ["a"]).summary


def _consumes_through(led: Ledger, required: list[str], others: list[str], count: int, version: int) -> bool:
    """On a copy of the ledger: occupy the required groups and the first ``count`` of the others
    that are still live (with redundancy a seal may abort the rest as surplus on the way), then can
    the trainer consume every buffer up to ``version``?"""
    copy = Ledger.restore(led.params, led.train_version, [e.copy() for e in led.entries()], {}, led.sealed)
    for g in required:
        copy.occupy(g)
    occupied = 0
    for g in others:
        if occupied == count:
            break
        if copy.entry(g) is not None:
            copy.occupy(g)
            occupied += 1
    try:
        while copy.train_version <= version:
            copy.consume()
    except LedgerError:
        return False
    return True


@given(
    eta=st.integers(0, 3),
    batch=st.integers(1, 3),
    redundancy=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    ops=st.lists(st.tuples(st.sampled_from("rrrroac"), st.integers(0, 50)), max_size=40),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_the_groups_named_are_exactly_what_the_buffer_needs(eta: int, batch: int, redundancy: float,
                                                            ops: list[tuple[str, int]], data: st.DataObject) -> None:
    """Occupying the required groups and the first ``needed - required`` of the others (in any
    order) makes every buffer up to the one asked about consumable; one group fewer does not."""
    led = run_ledger_ops(Ledger(LedgerParams(eta=eta, batch_size=batch, batch_redundancy=redundancy)), ops)
    version = data.draw(st.integers(led.train_version, led.train_version + eta))
    answer = explain(led, version, [], [], group_size=1)
    required = [g.group_id for g in answer.groups if g.required]
    others = [e.group_id for e in led.entries() if e.status is EntryStatus.RESERVED and e.group_id not in required]
    if answer.unreserved:
        assert not _consumes_through(led, required, others, len(others), version), "all live groups are not enough"
        return
    if led.capacity > batch:
        assert not required  # with redundancy a seal may abort any reserved group as surplus
    # the groups named, in the order named, are the first that make it consumable on the real ledger
    named = [g.group_id for g in answer.groups if not g.required]
    assert len(required) + len(named) >= answer.needed
    assert _consumes_through(led, required, named, len(named), version), "what it names is enough"
    if named:
        assert not _consumes_through(led, required, named, len(named) - 1, version), "and it needs the last"
    if required:
        order = data.draw(st.permutations(others))
        assert not _consumes_through(led, required[1:], order, len(order), version), "every required group is"
