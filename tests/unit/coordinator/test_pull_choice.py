"""Choosing per Pull whether it keeps the trajectories (``PullMode.AUTO``) and the decode speeds
it reads from the snapshots."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.engines import SimParams
from staleflow.config.strategy import MigrationMode, PullMode, StrategyConfig, SyncMode
from staleflow.cost_model import CostModel
from staleflow.engines.base import SamplingParams, TrajectoryRequest
from staleflow.engines.sim import SimCore
from staleflow.strategies import (
    AdmissionBudget,
    DecodeSpeeds,
    InstanceState,
    PendingTrajectory,
    RouteDecision,
    plan_cycle,
    route,
)
from staleflow.strategies.plan import CyclePlan, _keep_in_place, keeps_running

COST = CostModel(kv_budget=100_000)
AUTO = StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE, pull=PullMode.AUTO, route_by_speed=False)


def inst(name: str, version: int = 0, running: int = 2, speed: float = 1.0) -> InstanceState:
    return InstanceState(name, version, 20_000.0 * running, [f"{name}-r{i}" for i in range(running)], [], COST, speed)


def test_auto_keeps_the_pulls_of_instances_that_keep_up_and_interrupts_the_slow_ones() -> None:
    fleet = [inst("slow", speed=0.4), inst("even", speed=1.0), inst("quick", speed=1.3), inst("new", version=1)]
    on_instances = {t: PendingTrajectory(t, "g", 0, 20_000) for i in fleet for t in i.running}
    plan = plan_cycle(fleet, [], ps_version=1, admission={0: 0, 1: 0}, config=AUTO, on_instances=on_instances)
    assert sorted(plan.syncs) == ["even", "quick", "slow"]
    assert sorted(plan.kept) == ["even", "quick"]
    assert set(plan.interrupts) == {"slow"}, "only the slow instance's Pull hands its trajectories back"
    assert sorted(plan.interrupts["slow"]) == sorted(fleet[0].running)
    # routed again in the same pass: by the cost model alone the emptied instance gains the most,
    # weighed by the speeds they go to the instances that decode faster
    by_model = {d.traj_id: d.instance_id for d in plan.routes}
    assert set(by_model) == set(fleet[0].running) and set(by_model.values()) == {"slow"}
    by_speed = plan_cycle(fleet, [], ps_version=1, admission={0: 0, 1: 0}, on_instances=on_instances,
                          config=replace(AUTO, route_by_speed=True))
    moved = {d.traj_id: d.instance_id for d in by_speed.routes}
    assert set(moved) == set(fleet[0].running) and "slow" not in moved.values()


def test_keep_and_interrupt_ignore_the_speeds() -> None:
    fleet = [inst("slow", speed=0.2), inst("even")]
    for mode, kept in ((PullMode.KEEP, ["slow", "even"]), (PullMode.INTERRUPT, [])):
        assert keeps_running(["slow", "even"], fleet, StrategyConfig(pull=mode)) == kept


def test_auto_hands_back_the_work_of_a_loaded_instance_whose_peers_ran_dry() -> None:
    """The tail of a tight bound: one instance still holds many trajectories, its peers hold few;
    each of them would get tokens several times faster on a peer."""
    loaded, light = inst("loaded", running=40), inst("light", version=1, running=1)
    assert keeps_running(["loaded"], [loaded, light], AUTO) == []
    busy_peer = inst("busy", version=1, running=40)
    assert keeps_running(["loaded"], [loaded, busy_peer], AUTO) == ["loaded"], "nowhere faster: it keeps them"
    full_peer = InstanceState("full", 1, COST.kv_budget, ["full-r0"], [], COST)
    queued_peer = InstanceState("queued", 1, 20_000.0, ["queued-r0"], ["queued-w0"], COST)
    assert keeps_running(["loaded"], [loaded, full_peer, queued_peer], AUTO) == ["loaded"], \
        "a peer without room, or with a queue, is no place to move to"


@settings(max_examples=200, deadline=None)
@given(fleet=st.lists(st.tuples(st.integers(0, 40), st.floats(0.2, 3.0)), min_size=1, max_size=10),
       shares=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)))
def test_auto_keeps_fewer_pulls_as_the_share_grows(fleet, shares) -> None:
    instances = [inst(f"i{k}", running=n, speed=v) for k, (n, v) in enumerate(fleet)]
    syncs = [i.instance_id for i in instances]
    low, high = sorted(shares)
    kept_low = keeps_running(syncs, instances, replace(AUTO, keep_share=low))
    kept_high = keeps_running(syncs, instances, replace(AUTO, keep_share=high))
    assert set(kept_high) <= set(kept_low) and kept_low == [i for i in syncs if i in set(kept_low)]
    assert keeps_running(syncs, instances, replace(AUTO, keep_share=0.0)) == syncs
    # identical instances under the same load: a trajectory gets no faster anywhere, every Pull keeps
    same = [inst(f"s{k}", running=fleet[0][0], speed=fleet[0][1]) for k in range(len(fleet))]
    assert keeps_running([i.instance_id for i in same], same, replace(AUTO, keep_share=1.0)) == \
        [i.instance_id for i in same]


def test_keep_share_must_be_a_share() -> None:
    with pytest.raises(ValueError, match="keep_share"):
        StrategyConfig(keep_share=1.5)


def test_decode_speed_is_the_modelled_step_time_over_the_observed_one() -> None:
    speeds = DecodeSpeeds(weight=1.0, min_steps=8)
    step = COST.step_latency(40_000, 2)
    assert speeds.observe("a", 0, 0.0, 40_000, 2, COST) == 1.0, "no interval yet: as modelled"
    assert speeds.observe("a", 100, 100 * step * 2, 40_000, 2, COST) == pytest.approx(0.5)
    assert speeds.observe("a", 104, 300.0, 40_000, 2, COST) == pytest.approx(0.5), "too few steps: wait for more"
    # the steps of the short interval count with the next: 100 steps at twice the model's speed
    assert speeds.observe("a", 200, 100 * step * 2 + 100 * step / 2, 40_000, 2, COST) == pytest.approx(2.0)
    assert speeds.observe("a", None, None, 40_000, 2, COST) == pytest.approx(2.0), "an engine that does not report"
    assert speeds.observe("a", 5, 1.0, 40_000, 2, COST) == pytest.approx(2.0), "a restarted engine starts over"
    assert speeds.speed("other") == 1.0


def test_decode_speed_averages_intervals() -> None:
    speeds = DecodeSpeeds(weight=0.5, min_steps=1)
    step = COST.step_latency(0, 1)
    speeds.observe("a", 0, 0.0, 0, 1, COST)
    speeds.observe("a", 10, 10 * step, 0, 1, COST)  # as modelled
    assert speeds.observe("a", 20, 10 * step + 5 * step, 0, 1, COST) == pytest.approx(1.5)  # then twice as fast


def test_a_simulated_straggler_shows_its_slowdown_in_its_snapshots() -> None:
    """The sim engine's snapshots report its decode counters; a persistent slowdown of 2 reads as
    speed 0.5 against the cost model it decodes with."""
    estimates = {}
    for name, slowdown in (("even", 1.0), ("slow", 2.0)):
        core = SimCore(SimParams(slowdown=slowdown, noise=0.0), name)
        core.route([TrajectoryRequest(traj_id=f"{name}-{k}", group_id="g", prompt_ids=(1,) * 64, v_traj=0,
                                      sampling=SamplingParams(max_tokens=4096)) for k in range(4)])
        speeds = DecodeSpeeds(weight=1.0)
        for t in (0.0, 1.0, 2.0, 3.0):
            core.advance_to(t)
            snap = core.snapshot()
            estimates[name] = speeds.observe(name, snap.decode_steps, snap.decode_seconds, snap.kv_cache,
                                             len(snap.run_trajs), core.cost)
    assert estimates["even"] == pytest.approx(1.0, rel=0.05)
    assert estimates["slow"] == pytest.approx(0.5, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6), st.floats(0.91, 1.09)), min_size=1, max_size=6),
       lengths=st.lists(st.integers(50, 30_000), min_size=1, max_size=20))
def test_routing_by_speed_on_instances_as_fast_as_modelled_changes_nothing(loads, lengths) -> None:
    """Speeds within the tolerance are measurement error: the decisions are those of the cost model."""
    fleet = [inst(f"i{k}", version=v, running=n, speed=speed) for k, (v, n, speed) in enumerate(loads)]
    pending = [PendingTrajectory(f"t{k}", f"g{k}", 0, length, k) for k, length in enumerate(lengths)]
    plain = route(fleet, pending, AdmissionBudget({}), StrategyConfig(route_by_speed=False))
    assert route(fleet, pending, AdmissionBudget({}), StrategyConfig(route_by_speed=True)) == plain


def test_routing_by_speed_prefers_the_faster_of_two_equal_instances() -> None:
    slow, quick = inst("slow", running=1, speed=0.7), inst("quick", running=1, speed=1.0)
    pending = [PendingTrajectory("t", "g", 0, 1000)]
    by_model = route([slow, quick], pending, AdmissionBudget({}), StrategyConfig(route_by_speed=False))
    assert [d.instance_id for d in by_model] == ["slow"]
    by_speed = route([slow, quick], pending, AdmissionBudget({}), StrategyConfig(route_by_speed=True))
    assert [d.instance_id for d in by_speed] == ["quick"]


def test_migrations_routed_home_stay_on_every_kept_sync() -> None:
    """A migrated trajectory that routing sends back to its own instance is neither interrupted
    nor routed, on each kept sync in turn (not only the first); one routed elsewhere moves."""
    def routed(instance_id: str, traj_id: str) -> RouteDecision:
        return RouteDecision(instance_id, traj_id, "g", 0, False)

    plan = CyclePlan(syncs=["A", "B"], kept=["A", "B"], interrupts={"A": ["a1", "a2"], "B": ["b1", "b2"]},
                     routes=[routed("A", "a1"), routed("B", "b1"), routed("A", "b2")])
    _keep_in_place(plan, {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}, {"A", "B"})
    assert plan.interrupts == {"A": ["a2"], "B": ["b2"]}
    assert [(d.instance_id, d.traj_id) for d in plan.routes] == [("A", "b2")]
