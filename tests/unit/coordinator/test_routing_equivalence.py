"""The vectorised router (one gain evaluation for the whole fleet, a run of same-length
trajectories routed in one loop, runs of withheld trajectories tested at once, -inf gains where
something waits) decides exactly like a straightforward one written from Algorithms 2 and 3: one
trajectory at a time, one instance at a time, with ``CostModel.marginal_gain`` (times the
instance's decode speed when routing by speed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.plain_decisions import COSTS, routing_states, straightforward_route

from staleflow.config.strategy import StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.strategies import AdmissionBudget, InstanceState, PendingTrajectory, route


@settings(max_examples=400, deadline=None)
@given(routing_states())
def test_vectorised_routing_decides_like_the_straightforward_one(state) -> None:
    instances, pending, admission, group_versions, config = state
    expected = straightforward_route(instances, pending, AdmissionBudget(admission), config, group_versions)
    for lookahead in (True, False):
        assert route(instances, pending, AdmissionBudget(admission), config, group_versions,
                     lookahead=lookahead) == expected



def test_a_group_on_identical_instances_fills_them_in_order() -> None:
    """Sixteen members of one prompt on eight idle instances of one model: every tie goes to the
    first instance, as the straightforward router decides."""
    cost = CostModel(kv_budget=60_000)
    instances = [InstanceState(f"i{i}", 0, 0.0, [], [], cost) for i in range(8)]
    pending = [PendingTrajectory(f"g0-{m}", "g0", None, 900, m) for m in range(16)]
    config = StrategyConfig(mu=0.3)
    expected = straightforward_route(instances, pending, AdmissionBudget({0: 4}), config, {})
    decided = route(instances, pending, AdmissionBudget({0: 4}), config, {})
    assert decided == expected
    assert [d.instance_id for d in decided[:8]] == [f"i{i}" for i in range(8)]


@st.composite
def loaded_fleets(draw):
    """A loaded fleet of one cost model and many partials at random lengths: routes and withheld
    trajectories alternate, so trajectories are withheld from the bounds of shorter ones that
    instances routed to since may have raised."""
    cost = draw(st.sampled_from(COSTS))
    instances = []
    for i in range(draw(st.integers(1, 12))):
        running = draw(st.integers(0, 60))
        kv = draw(st.floats(0, cost.kv_budget)) if running else 0.0
        instances.append(InstanceState(f"i{i}", draw(st.integers(1, 3)), kv, [f"i{i}-r{k}" for k in range(running)],
                                       [f"i{i}-w{k}" for k in range(draw(st.sampled_from([0, 0, 0, 1])))], cost))
    longest = int(cost.kv_budget / cost.k5 / 2)
    pending = [PendingTrajectory(f"t{k}", f"g{k}", draw(st.integers(1, 2)), draw(st.integers(1, longest)), k)
               for k in range(draw(st.integers(1, 80)))]
    config = StrategyConfig(mu=draw(st.sampled_from([0.05, 0.3, 0.6, 0.9])), scan_withheld=draw(st.booleans()),
                            max_in_flight=draw(st.sampled_from([None, None, 200, 1_000])))
    return instances, pending, config


@settings(max_examples=300, deadline=None)
@given(loaded_fleets())
def test_withholding_from_shorter_lengths_decides_like_the_straightforward_one(state) -> None:
    instances, pending, config = state
    expected = straightforward_route(instances, pending, AdmissionBudget({}), config, {})
    for lookahead in (True, False):
        assert route(instances, pending, AdmissionBudget({}), config, {}, lookahead=lookahead) == expected


@settings(max_examples=200, deadline=None)
@given(loaded_fleets(), st.integers(0, 11))
def test_a_pass_stopped_at_an_instance_decides_the_first_decisions_of_a_whole_one(state, stop) -> None:
    """``stop_at_instance`` (a tentative sync's question) ends the pass at its first route to that
    instance: the whole pass's decisions up to that one."""
    instances, pending, config = state
    whole = route(instances, pending, AdmissionBudget({}), config, {})
    stopped = route(instances, pending, AdmissionBudget({}), config, {}, stop_at_instance=f"i{stop}")
    first = next((k for k, d in enumerate(whole) if d.instance_id == f"i{stop}"), len(whole) - 1)
    assert stopped == whole[:first + 1]


def test_a_long_trajectory_after_a_withheld_shorter_one_is_withheld_from_its_bound(monkeypatch) -> None:
    """Two loaded instances, a short trajectory that routes, then one withheld and longer ones:
    the longer ones are withheld from the bound of the withheld one, the decisions the same."""
    from staleflow.strategies import withheld_bounds

    answers: list[bool] = []
    withholds = withheld_bounds.WithheldBounds.withholds
    monkeypatch.setattr(withheld_bounds.WithheldBounds, "withholds",
                        lambda self, *args: answers.append(withholds(self, *args)) or answers[-1])
    cost = CostModel(kv_budget=60_000)
    instances = [InstanceState(f"i{i}", 1, 40_000.0, [f"i{i}-r{k}" for k in range(30)], [], cost) for i in range(2)]
    pending = [PendingTrajectory(f"t{k}", f"g{k}", 1, length, k)
               for k, length in enumerate([200, 19_000, 100, 19_500, 19_800])]
    config = StrategyConfig(mu=0.3)
    decided = route(instances, pending, AdmissionBudget({}), config, {})
    assert decided == straightforward_route(instances, pending, AdmissionBudget({}), config, {})
    assert [d.traj_id for d in decided] == ["t0", "t2"]
    assert answers.count(True) == 2


@settings(max_examples=300, deadline=None)
@given(loaded_fleets(), st.integers(1, 200_000))
def test_the_approximate_gains_stay_within_their_error_of_the_exact_ones(state, length) -> None:
    """``best_free`` rounds differently from the exact arithmetic; its decisions rest on the
    difference staying below ``approximation_error`` (here a margin of 8 under it)."""
    import numpy as np

    from staleflow.strategies.routing import _Fleet

    instances, _, config = state
    fleet = _Fleet(instances, mu=config.mu)
    assert fleet.approximate
    exact = fleet.gains_for(length)
    approximate = fleet.approximate_gains(length)
    fits = (fleet.room < np.inf) & (fleet.kv + fleet.k5 * length <= fleet.room)
    assert np.all(np.abs(approximate[fits] - exact[fits]) <= fleet.approximation_error / 8)
    best = fleet.best_free(length, 0, len(instances), config.mu * fleet.ideal_gain(length))
    if best is not None and best[1] >= config.mu * fleet.ideal_gain(length):
        assert best == (int(exact.argmax()), float(exact.max()))
