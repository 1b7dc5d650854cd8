"""Length-aware routing, the reservation cap and adaptive redundancy's sizing (pure strategies),
and both in whole simulated jobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.strategy import StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.simulation import ClusterSimulation, RunResult, scenario
from staleflow.simulation.experiment import Point, SimulatedJob
from staleflow.simulation.systems import catalog
from staleflow.strategies import AdmissionBudget, InstanceState, PendingTrajectory, plan_cycle, route
from staleflow.strategies.over_reservation import extra_groups, predicted_tail, reservation_cap

COST = CostModel(kv_budget=30_000)


def idle(name: str, version: int = 0) -> InstanceState:
    return InstanceState(name, version, 0.0, [], [], COST)


# ---------------------------------------------------------------------- length-aware routing


def test_the_longest_predicted_trajectory_of_a_level_goes_first() -> None:
    """One instance with room for one of two partials of the same version: arrival order routes
    the first to arrive, length-aware routing the one predicted to run longest."""
    full = InstanceState("a", 0, 10_000.0, [f"r{k}" for k in range(3)], [], COST)
    pending = [PendingTrajectory("short", "g1", 0, 9_000, seq=1, remaining=500),
               PendingTrajectory("long", "g2", 0, 9_000, seq=2, remaining=12_000)]
    fifo = route([full], pending, AdmissionBudget({}), StrategyConfig())
    longest = route([full], pending, AdmissionBudget({}), StrategyConfig(length_aware=True))
    assert [d.traj_id for d in fifo][:1] == ["short"]
    assert [d.traj_id for d in longest][:1] == ["long"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(100, 8_000), st.floats(0, 20_000)), min_size=1, max_size=40),
       st.integers(1, 4))
def test_length_aware_routing_changes_the_order_not_what_is_admissible(trajs, fleet) -> None:
    """Every decision still respects the versions (a versioned trajectory only on an instance at
    least as new); with predictions all equal it decides exactly as arrival order does."""
    instances = [idle(f"i{k}", version=k % 3) for k in range(fleet)]
    pending = [PendingTrajectory(f"t{k}", f"g{k}", v, length, k, remaining)
               for k, (v, length, remaining) in enumerate(trajs)]
    versions = {i.instance_id: i.version for i in instances}
    by_id = {t.traj_id: t for t in pending}
    for decision in route(instances, pending, AdmissionBudget({}), StrategyConfig(length_aware=True)):
        assert versions[decision.instance_id] >= by_id[decision.traj_id].v_traj
    flat = [replace(t, remaining=1.0) for t in pending]
    assert route(instances, flat, AdmissionBudget({}), StrategyConfig(length_aware=True)) == \
        route(instances, flat, AdmissionBudget({}), StrategyConfig())


# ---------------------------------------------------------------------- the reservation cap


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 12), st.integers(1, 8), st.integers(0, 3))
def test_a_pass_reserves_no_more_groups_than_its_cap(cap, groups, versions) -> None:
    instances = [idle(f"i{v}", version=v) for v in range(versions + 1)]
    pending = [PendingTrajectory(f"g{g}-{m}", f"g{g}", None, 200, 4 * g + m) for g in range(groups) for m in range(4)]
    admission = {v: 50 for v in range(versions + 1)}
    plan = plan_cycle(instances, pending, versions, admission, StrategyConfig(), new_groups=cap)
    reserved = {d.group_id for d in plan.routes if d.reserves_group}
    assert len(reserved) == min(cap, groups)
    uncapped = plan_cycle(instances, pending, versions, admission, StrategyConfig())
    assert {d.group_id for d in uncapped.routes if d.reserves_group} == {f"g{g}" for g in range(groups)}


def test_a_capped_budget_still_follows_the_ledgers_table() -> None:
    budget = AdmissionBudget({0: 1, 1: 5}, new_groups=3)
    assert budget.max_new_groups() == 3
    budget.take(0)
    assert not budget.allows(0) and budget.allows(1) and budget.max_new_groups() == 2
    budget.take(1)
    budget.take(1)
    assert not budget.allows(1) and budget.max_new_groups() == 0
    assert AdmissionBudget({0: 1}, new_groups=0).max_new_groups() == 0


# ---------------------------------------------------------------------- adaptive redundancy


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 50), st.floats(0, 50), st.integers(0, 200), st.floats(1.01, 10))
def test_extra_groups_grow_with_the_tail_within_the_ledgers_surplus(tail, more, capacity, threshold) -> None:
    fewer, most = extra_groups(tail, capacity, threshold), extra_groups(tail + more, capacity, threshold)
    assert 0 <= fewer <= most <= capacity
    assert extra_groups(min(tail, 1.0), capacity, threshold) == 0
    assert extra_groups(max(tail, threshold), capacity, threshold) == capacity


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2_000), st.integers(1, 256), st.integers(0, 4), st.integers(0, 100), st.floats(0, 10))
def test_the_cap_keeps_eta_plus_one_batches_and_what_the_tail_adds(live, batch, eta, surplus, tail) -> None:
    cap = reservation_cap(live, batch, eta, surplus, tail, 2.0)
    assert cap >= 0
    assert live + cap >= (eta + 1) * batch or cap == 0
    assert live + cap <= (eta + 1) * batch + surplus or cap == 0


def test_the_tail_is_the_longest_remainder_over_a_typical_length_and_bad_input_is_refused() -> None:
    assert predicted_tail([100, 9_000, 400], 3_000) == 3.0
    assert predicted_tail([], 3_000) == 0.0
    with pytest.raises(ValueError, match="typical_length"):
        predicted_tail([1], 0)
    with pytest.raises(ValueError, match="tail_threshold"):
        extra_groups(2, 8, 1.0)
    with pytest.raises(ValueError, match="tail_threshold"):
        StrategyConfig(tail_threshold=1.0)


# ---------------------------------------------------------------------- whole jobs

CI = scenario("ci", seed=0)
SYSTEMS = {s.name: s for s in catalog(CI.redundancy)}


def simulate(name: str, eta: int = 2, steps: int = 6) -> tuple[ClusterSimulation, RunResult]:
    simulation = ClusterSimulation(SimulatedJob(Point(0, eta, CI), SYSTEMS[name], 2, steps).config())
    return simulation, simulation.run(steps)


@pytest.mark.parametrize("name", ["sf-rsm+len", "sf-rsm+adaptive", "sf-rsm+len+adaptive"])
def test_predicting_jobs_keep_the_bound_and_learn_from_completions(name: str) -> None:
    simulation, result = simulate(name)
    assert result.violations == 0
    assert all(rec.groups == 4 and rec.trajectories == 16 for rec in result.step_records)
    assert simulation.lengths is not None and simulation.lengths.predictor.observed >= 6 * 16


def test_adaptive_redundancy_reserves_no_more_than_the_fixed_ratio() -> None:
    """The same ledger capacity: the fixed ratio uses all of it, the adaptive one only what the
    tail calls for, so it never cancels more surplus groups."""
    _, fixed = simulate("sf-rsm+batch")
    _, adaptive = simulate("sf-rsm+adaptive")
    assert fixed.counters["surplus_groups"] > 0
    assert adaptive.counters["surplus_groups"] <= fixed.counters["surplus_groups"]
