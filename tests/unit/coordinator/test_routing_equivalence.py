"""The vectorised router (one gain evaluation for the whole fleet, a run of same-length
trajectories routed in one loop, runs of withheld trajectories tested at once, -inf gains where
something waits) decides exactly like a straightforward one written from Algorithms 2 and 3: one
trajectory at a time, one instance at a time, with ``CostModel.marginal_gain`` (times the
instance's decode speed when routing by speed)."""

from __future__ import annotations

from hypothesis import given, settings
from support.plain_decisions import routing_states, straightforward_route

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
