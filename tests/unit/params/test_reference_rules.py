"""The reference rules (reference-oriented storage), pure: source choice, pipeline order,
retention, unpublish ordering, soft state; hypothesis over holder sets and churn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.params import default_retain
from staleflow.errors import ErrorCode
from staleflow.servers.params.reference import PS, ReferenceError, ReferenceTable, retained_versions


def table(retain: int = 2, replicas: int = 2, ttl: float = 10.0) -> ReferenceTable:
    return ReferenceTable(retain, replicas, ttl)


def holder(t: ReferenceTable, name: str, host: str = "h0", zone: str = "", spot: bool = False, now: float = 0.0,
           holdings: dict | None = None) -> None:
    t.heartbeat(name, f"http://{name}", host, zone, spot, holdings or {}, now)


def test_sources_prefer_the_pullers_host_then_its_zone_then_others_then_the_ps() -> None:
    t = table()
    t.known(5, 4, ps_copy=True)
    holder(t, "far", host="h9", zone="z9", holdings={5: None})
    holder(t, "zone", host="h2", zone="z1", holdings={5: None})
    holder(t, "host", host="h1", zone="z1", holdings={5: None})
    found = t.sources(5, 0, "puller", "h1", "z1", now=1.0)
    assert [s.holder_id for s in found] == ["host", "zone", "far", PS]
    assert [s.tier for s in found] == ["host", "zone", "other", "ps"]


def test_the_least_loaded_holder_of_a_tier_is_first_and_an_assignment_is_its_load() -> None:
    t = table()
    t.known(1, 2, ps_copy=False)
    holder(t, "a", holdings={1: None})
    holder(t, "b", holdings={1: None})
    first = t.sources(1, 0, "p1", "h0", "", 1.0)[0].holder_id
    second = t.sources(1, 0, "p2", "h0", "", 1.0)[0].holder_id
    assert {first, second} == {"a", "b"}, "the second puller goes to the idle holder"
    assert t.load(first) == 1 and t.load(second) == 1
    t.release("p1")
    assert t.load(first) == 0
    # asking again replaces the puller's previous assignment rather than adding one
    t.sources(1, 1, "p2", "h0", "", 1.0)
    assert t.load("a") + t.load("b") == 1


def test_a_burst_forms_a_chain_of_pullers_not_a_fan_out_from_the_ps() -> None:
    t = table()
    t.known(3, 8, ps_copy=True)
    upstream = {}
    for i in range(6):
        holder(t, f"p{i}", now=0.0)
        t.publish(f"p{i}", 3, [], now=0.0)  # joins the version's pipeline
        upstream[i] = t.sources(3, 0, f"p{i}", "h0", "", 0.0)[0].holder_id
    assert upstream[0] == PS
    assert [upstream[i] for i in range(1, 6)] == [f"p{i - 1}" for i in range(1, 6)], "each reads from the one before"
    assert t.load(PS) == 1


def test_a_pipeline_source_never_waits_on_a_puller_that_joined_after_it() -> None:
    t = table()
    t.known(3, 4, ps_copy=False)
    holder(t, "early")
    holder(t, "late")
    t.publish("early", 3, [], 0.0)
    t.publish("late", 3, [0, 1], 0.0)
    with pytest.raises(ReferenceError) as refused:
        t.sources(3, 2, "early", "h0", "", 0.0)  # only "late" could get it, and it joined later
    assert refused.value.code is ErrorCode.VERSION_UNAVAILABLE
    assert [s.holder_id for s in t.sources(3, 0, "early", "h0", "", 0.0)] == ["late"], "a chunk it has is fine"
    assert [s.holder_id for s in t.sources(3, 3, "late", "h0", "", 0.0)] == ["early"]


def test_version_unavailable_when_nobody_can_serve_and_for_excluded_sources() -> None:
    t = table()
    with pytest.raises(ReferenceError) as unknown:
        t.sources(9, 0, "p", "h0", "", 0.0)
    assert unknown.value.code is ErrorCode.VERSION_UNAVAILABLE
    t.known(9, 1, ps_copy=True)
    holder(t, "a", holdings={9: None})
    with pytest.raises(ReferenceError) as excluded:
        t.sources(9, 0, "p", "h0", "", 0.0, exclude=["a", PS])
    assert excluded.value.code is ErrorCode.VERSION_UNAVAILABLE
    with pytest.raises(ReferenceError) as chunk:
        t.sources(9, 1, "p", "h0", "", 0.0)
    assert chunk.value.code is ErrorCode.UNKNOWN_CHUNK


def test_holders_are_soft_state_a_lapsed_holder_is_no_source_and_is_forgotten() -> None:
    t = table(ttl=10)
    t.known(1, 1, ps_copy=False)
    holder(t, "a", now=0.0, holdings={1: None})
    assert t.sources(1, 0, "p", "h0", "", 9.0)[0].holder_id == "a"
    with pytest.raises(ReferenceError):
        t.sources(1, 0, "p", "h0", "", 11.0)
    assert t.expire(11.0) == ["a"] and not t.holders
    with pytest.raises(ReferenceError) as unknown:
        t.publish("a", 1, None, 12.0)
    assert unknown.value.code is ErrorCode.UNKNOWN_HOLDER
    holder(t, "a", now=12.0, holdings={1: None})  # the next heartbeat rebuilds it
    assert t.available(1, 12.0)


def test_a_complete_set_of_chunks_is_the_whole_version() -> None:
    t = table()
    t.known(1, 3, ps_copy=False)
    holder(t, "a")
    t.publish("a", 1, [0, 2, 1], 0.0)
    assert t.holders["a"].holds_whole(1)


def test_the_ps_drops_its_copy_once_enough_non_spot_holders_hold_it() -> None:
    t = table(retain=2, replicas=2)
    t.known(1, 1, ps_copy=True)
    holder(t, "spot1", spot=True, holdings={1: None})
    holder(t, "spot2", spot=True, holdings={1: None})
    holder(t, "a", holdings={1: None})
    assert t.plan(0.0).drop == [], "spot holders never count"
    holder(t, "b", holdings={1: None})
    assert t.plan(0.0).drop == [1]


def test_the_ps_takes_a_copy_back_before_the_count_reaches_zero() -> None:
    t = table(retain=1, replicas=2)
    t.known(1, 1, ps_copy=False)
    holder(t, "a", holdings={1: None})
    holder(t, "b", holdings={1: None})
    assert t.plan(0.0).copy_back == {}
    t.finish_unpublish("b", 1)
    assert t.plan(0.0).copy_back == {1: ["a"]}, "one left: copy it back from that one while it is there"


def test_a_silent_holder_stops_counting_at_half_its_ttl_so_the_copy_starts_before_it_is_declared_failed() -> None:
    t = table(retain=1, replicas=1, ttl=10)
    t.known(1, 1, ps_copy=False)
    holder(t, "a", now=0.0, holdings={1: None})
    assert t.plan(4.0).copy_back == {}
    assert t.plan(6.0).copy_back == {1: ["a"]}, "still fresh (a source), no longer trusted"
    assert t.expire(6.0) == []


def test_unpublishing_the_last_holder_waits_for_the_copy_back() -> None:
    t = table(retain=1, replicas=1)
    t.known(1, 1, ps_copy=False)
    holder(t, "a", holdings={1: None})
    holder(t, "p")
    t.withdraw("a", 1)
    with pytest.raises(ReferenceError):
        t.sources(1, 0, "p", "h0", "", 0.0)  # withdrawn at once: no new puller is sent there
    assert not t.unpublish_safe("a", 1, 0.0)
    assert t.plan(0.0).copy_back == {1: ["a"]}, "the PS copies back from the withdrawing holder"
    holder(t, "a", holdings={1: None})  # a heartbeat sent before the unpublish does not undo it
    assert 1 in t.holders["a"].withdrawing
    t.ps_copy(1, True)
    assert t.unpublish_safe("a", 1, 0.0)
    t.finish_unpublish("a", 1)
    assert 1 not in t.holders["a"].holdings


def test_versions_past_retention_may_be_dropped_by_anyone() -> None:
    t = table(retain=2, replicas=1)
    for v in (1, 2, 3):
        t.known(v, 1, ps_copy=False)
    holder(t, "a", holdings={1: None})
    assert t.retained() == [2, 3]
    assert t.unpublish_safe("a", 1, 0.0)
    assert t.plan(0.0).forget == [1]


def test_retained_versions_and_the_default_from_eta() -> None:
    assert retained_versions([4, 1, 3, 2], 2) == [3, 4]
    assert default_retain(2) == 3


holder_ops = st.lists(st.tuples(
    st.sampled_from(["heartbeat", "publish", "unpublish", "expire", "pull", "drop", "copy"]),
    st.integers(0, 4),  # which holder
    st.integers(0, 3),  # which version
    st.booleans(),  # spot
    st.floats(0, 4),  # time step
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=holder_ops)
def test_churn_never_loses_a_retained_version_the_rules_protect(ops: list) -> None:
    """Holders come, go silent, unpublish (only when the rules say it is safe) and the PS follows
    its plan (drop, copy back at once): every retained version that was available stays available,
    sources never name a withdrawing or lapsed holder, and pipeline waits never form a cycle."""
    t = table(retain=2, replicas=2, ttl=10)
    now = 0.0
    for v in range(4):
        t.known(v, 3, ps_copy=True)
    for op, h, v, spot, step in ops:
        now += step
        name = f"h{h}"
        if op == "heartbeat":
            holdings = dict(t.holders[name].holdings) if name in t.holders else {}
            holder(t, name, spot=spot, now=now, holdings=holdings)
        elif op == "publish" and name in t.holders:
            t.publish(name, v, None if spot else [0], now)
        elif op == "unpublish" and name in t.holders and v in t.holders[name].holdings:
            t.withdraw(name, v)
            _follow_plan(t, now)  # the PS copies back from it
            assert t.unpublish_safe(name, v, now), "after the PS followed its plan an unpublish may finish"
            t.finish_unpublish(name, v)
        elif op == "expire":
            _follow_plan(t, now)  # copies start before a holder is declared failed
            t.expire(now + 10)
            now += 10
        elif op == "pull":
            _check_sources(t, v, name, now)
        _follow_plan(t, now)
        for version in t.retained():
            assert t.available(version, now), f"retained version {version} became unavailable"


def _follow_plan(t: ReferenceTable, now: float) -> None:
    plan = t.plan(now)
    for version in plan.copy_back:
        t.ps_copy(version, True)
    for version in plan.drop:
        t.ps_copy(version, False)
        assert len(t.counted_holders(version, now)) >= t.replicas
    for version in plan.forget:
        t.ps_copy(version, False)


def _check_sources(t: ReferenceTable, version: int, puller: str, now: float) -> None:
    if version not in t.retained():
        return
    found = t.sources(version, 0, puller, "h0", "", now)
    for source in found:
        if source.holder_id == PS:
            assert version in t.ps_copies
            continue
        record = t.holders[source.holder_id]
        assert version not in record.withdrawing and t.fresh(record, now) and source.holder_id != puller
        if not source.has_chunk:
            assert record.joined[version] < t.holders[puller].joined[version]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_pipeline_waits_form_a_dag(publish_order: list[int]) -> None:
    """Whatever order pullers join and progress in, following each one's first source never loops."""
    t = table(retain=1, replicas=1)
    t.known(0, 4, ps_copy=True)
    for step, who in enumerate(publish_order):
        name = f"p{who}"
        if name not in t.holders:
            holder(t, name)
        t.publish(name, 0, range(step % 4), 0.0)
    edges = {}
    for name in t.holders:
        for chunk in range(4):
            if not t.holders[name].has_chunk(0, chunk):
                edges.setdefault(name, set()).add(t.sources(0, chunk, name, "h0", "", 0.0)[0].holder_id)
    for start in edges:
        seen, frontier = set(), [start]
        while frontier:
            node = frontier.pop()
            assert node not in seen or node == PS, f"a cycle through {node}"
            seen.add(node)
            frontier.extend(n for n in edges.get(node, ()) if t.holders.get(n) is None or
                            not t.holders[n].has_chunk(0, 0))


def test_a_holder_a_puller_reports_failed_is_no_source_until_its_next_heartbeat() -> None:
    t = table(retain=1, replicas=1)
    t.known(1, 1, ps_copy=True)
    holder(t, "a", holdings={1: None})
    t.report_failed(["a", "gone"])
    assert [s.holder_id for s in t.sources(1, 0, "p", "h0", "", 0.0)] == [PS]
    assert t.counted_holders(1, 0.0) == [], "a suspect holder does not count for retention"
    holder(t, "a", now=1.0, holdings={1: None})
    assert [s.holder_id for s in t.sources(1, 0, "p", "h0", "", 1.0)] == ["a", PS]


def test_sources_for_a_run_of_chunks_name_a_holder_only_if_it_has_them_all_or_joined_before() -> None:
    t = table()
    t.known(1, 6, ps_copy=True)
    holder(t, "early")
    holder(t, "p")
    t.publish("early", 1, [0, 1, 2], 0.0)
    t.publish("p", 1, [], 0.0)
    found = t.sources(1, 0, "p", "h0", "", 0.0, count=6)
    assert [(s.holder_id, s.has_chunk) for s in found] == [("early", False), (PS, True)]
    assert [(s.holder_id, s.has_chunk) for s in t.sources(1, 0, "p", "h0", "", 0.0, count=3)][0] == ("early", True)
    assert [s.holder_id for s in t.sources(1, 2, "outsider", "h0", "", 0.0, count=2)] == [PS], \
        "a puller that is no holder only gets sources that have the whole run"


@settings(max_examples=100, deadline=None)
@given(st.permutations(range(8)))
def test_a_burst_is_a_chain_whatever_order_the_asks_come_in(ask_order: list[int]) -> None:
    """Eight pullers join in order and then ask in any order: every source serves one puller."""
    t = table()
    t.known(3, 8, ps_copy=True)
    for i in range(8):
        holder(t, f"p{i}")
        t.publish(f"p{i}", 3, [], 0.0)
    upstream = {i: t.sources(3, 0, f"p{i}", "h0", "", 0.0)[0].holder_id for i in ask_order}
    assert sorted(upstream.values()) == sorted([PS, *(f"p{i}" for i in range(7))]), upstream
