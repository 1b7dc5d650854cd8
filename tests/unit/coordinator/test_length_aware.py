"""Length-aware routing and adaptive redundancy's sizing (pure strategies), and both in whole
simulated jobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.manager import LedgerParams
from staleflow.config.strategy import StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.ledger import Ledger
from staleflow.simulation import ClusterSimulation, RunResult, scenario
from staleflow.simulation.experiment import Point, SimulatedJob
from staleflow.simulation.systems import catalog
from staleflow.strategies import AdmissionBudget, InstanceState, PendingTrajectory, route
from staleflow.strategies.over_reservation import extra_groups, predicted_tail, spare_admission

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


# ---------------------------------------------------------------------- adaptive redundancy


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 50), st.floats(0, 50), st.integers(0, 200), st.floats(0.5, 10))
def test_extra_groups_grow_with_the_tail_within_the_ledgers_surplus(tail, more, capacity, threshold) -> None:
    fewer, most = extra_groups(tail, capacity, threshold), extra_groups(tail + more, capacity, threshold)
    assert 0 <= fewer <= most <= capacity
    assert extra_groups(min(tail, threshold), capacity, threshold) == 0
    assert extra_groups(max(tail, 2 * threshold), capacity, threshold) == capacity


def ledger(capacity: int, eta: int, groups: int) -> Ledger:
    """B = 4, ``capacity`` groups per buffer, ``groups`` reserved at version 0."""
    ledger = Ledger(LedgerParams(eta, 4, batch_redundancy=(capacity - 4) / 4))
    for k in range(groups):
        ledger.reserve(f"g{k}", 0)
    return ledger


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.integers(0, 4), st.data())
def test_withheld_admission_is_what_a_ledger_without_the_unused_surplus_admits(eta, unused, data) -> None:
    """Two real ledgers holding the same groups, of capacity B + 4 and B + 4 - unused: the table
    withheld from the first is the second's for new groups (at the trainer's version), and never
    above the first's."""
    groups = data.draw(st.integers(0, 4 * (eta + 1)))
    big, small = ledger(8, eta, groups), ledger(8 - unused, eta, groups)
    withheld = spare_admission(big.admission(), eta, unused)
    assert withheld == small.admission()
    assert all(0 <= n <= big.admission()[v] for v, n in withheld.items())
    assert spare_admission(big.admission(), eta, 0) == big.admission()


def test_the_tail_is_the_longest_remainder_over_a_typical_length_and_bad_input_is_refused() -> None:
    assert predicted_tail([100, 9_000, 400], 3_000) == 3.0
    assert predicted_tail([], 3_000) == 0.0
    with pytest.raises(ValueError, match="typical_length"):
        predicted_tail([1], 0)
    with pytest.raises(ValueError, match="tail_threshold"):
        extra_groups(2, 8, 0)
    with pytest.raises(ValueError, match="unused_per_buffer"):
        spare_admission({0: 3}, 1, -1)
    with pytest.raises(ValueError, match="tail_threshold"):
        StrategyConfig(tail_threshold=0)


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
