"""The decision pass (``plan_cycle``: instances copied only where a step changes them, the
waiting trajectories read once for sync, migration and repack, the vectorised router) decides
exactly like the plain one (every instance copied, every step reading the waiting trajectories
afresh, the straightforward router), on random coordinator snapshots and every strategy a
simulated system runs; and it leaves its inputs as they were."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st
from support.plain_decisions import plain_plan_cycle, snapshots

from staleflow.config.strategy import StrategyConfig
from staleflow.simulation.systems import catalog
from staleflow.strategies import plan_cycle

STRATEGIES = sorted({spec.strategy for spec in catalog()} | {StrategyConfig()}, key=repr)


@settings(max_examples=200, deadline=None)
@given(snapshots(), st.sampled_from(STRATEGIES))
def test_the_decision_pass_decides_like_the_plain_one(snapshot, config: StrategyConfig) -> None:
    instances, pending, ps_version, admission, on_instances, repack_previous = snapshot
    before = copy.deepcopy(instances)
    plan = plan_cycle(instances, pending, ps_version, admission, config, on_instances, repack_previous=repack_previous)
    assert instances == before, "the snapshots are not modified"
    plain = plain_plan_cycle(instances, pending, ps_version, admission, config, on_instances, repack_previous)
    assert plan == plain
