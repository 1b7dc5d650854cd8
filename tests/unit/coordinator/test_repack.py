"""Repack (Laminar Algorithm 1) on hand-made instance sets, and its invariants by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.strategy import MigrationMode, StrategyConfig, SyncMode
from staleflow.cost_model import CostModel
from staleflow.strategies import InstanceState, PendingTrajectory, plan_cycle
from staleflow.strategies.repack import KvReadings, plan_repack, ramping_down, roofline_batch

COST = CostModel(kv_budget=100_000)
CONFIG = StrategyConfig(migration=MigrationMode.REPACK, repack_batch=8)


def inst(name: str, usage: float, running: int, version: int = 0, waiting: int = 0) -> InstanceState:
    return InstanceState(name, version, usage * COST.kv_budget, [f"{name}-r{i}" for i in range(running)],
                         [f"{name}-w{i}" for i in range(waiting)], COST, kv_usage=usage)


def falling(*instances: InstanceState) -> dict[str, float]:
    """Previous readings just above the current ones: every instance is ramping down."""
    return {i.instance_id: (i.kv_usage or 0.0) + 0.01 for i in instances}


def moves(instances: list[InstanceState], previous: dict[str, float] | None = None,
          config: StrategyConfig = CONFIG) -> list[tuple[str, str]]:
    return [(m.source, m.destination) for m in plan_repack(instances, previous or falling(*instances), config)]


def test_roofline_batch_from_the_cost_model() -> None:
    cost = CostModel(k2=1e-3, k3=1e-4, k4=1e-2)
    # one trajectory: 1e-3 + 1e-2 = 11 ms; 10 % more is 12.1 ms, so k3 x n <= 2.1 ms: n = 21
    assert roofline_batch(cost, 0.1) == 21
    assert roofline_batch(cost, 0.0) == 10  # the memory-bound floor: k2 / k3
    assert roofline_batch(cost, 1.0) > roofline_batch(cost, 0.5) > roofline_batch(cost, 0.1)
    with pytest.raises(ValueError, match="repack_batch"):
        roofline_batch(CostModel(k3=0.0), 0.1)


def test_only_ramping_down_instances_are_candidates() -> None:
    at_plateau = inst("plateau", 0.995, 4)  # at C_max: waiting work keeps it full
    rising = inst("rising", 0.3, 4)
    wide = inst("wide", 0.2, 8)  # B = 8 trajectories: not fewer than B
    empty = inst("empty", 0.0, 0)
    low = inst("low", 0.2, 2)
    previous = {"plateau": 0.999, "rising": 0.2, "wide": 0.5, "empty": 0.1, "low": 0.3}
    assert [ramping_down(i, previous[i.instance_id], CONFIG) for i in (at_plateau, rising, wide, empty, low)] == \
        [False, False, False, False, True]
    assert not ramping_down(low, None, CONFIG), "no previous reading: not known to fall"
    assert ramping_down(low, 0.2, CONFIG), "non-increasing: an unchanged reading counts"
    # only "low" qualifies, and a plan needs two candidates
    assert moves([at_plateau, rising, wide, empty, low], previous) == []


def test_smallest_source_goes_to_the_densest_destination_that_fits() -> None:
    a, b, c = inst("a", 0.1, 1), inst("b", 0.3, 2), inst("c", 0.5, 2)
    # a (smallest) goes to c (densest); then b fits c (0.6 + 0.3, 5 trajectories)
    assert moves([c, b, a]) == [("a", "c"), ("b", "c")]
    plan = plan_repack([a, b, c], falling(a, b, c), CONFIG)
    assert plan[0].trajectories == tuple(a.running)


def test_kv_limit_and_batch_limit_are_never_exceeded() -> None:
    a, b, c = inst("a", 0.3, 1), inst("b", 0.4, 1), inst("c", 0.65, 1)
    # a -> c would be 0.95 <= 0.99; then b fits neither c (1.35) nor a (emptied)
    assert moves([a, b, c]) == [("a", "c")]
    tight = StrategyConfig(migration=MigrationMode.REPACK, repack_batch=8, repack_kv_share=0.9)
    assert moves([a, b, c], config=tight) == [("a", "b")]  # c would reach 0.95 > 0.9
    many = [inst("x", 0.1, 5), inst("y", 0.2, 4)]
    assert moves(many) == [], "5 + 4 trajectories exceed B = 8"


def test_moves_stay_within_a_version_group() -> None:
    old, new = inst("old", 0.1, 1, version=0), inst("new", 0.2, 1, version=1)
    assert moves([old, new]) == []
    also_old = inst("old2", 0.3, 1, version=0)
    assert moves([old, new, also_old]) == [("old", "old2")]


def test_a_destination_is_not_moved_again() -> None:
    # a goes to b (b and e tie as densest; b first by name); b, next, must not move on to e with
    # a's trajectories: e moves to b instead
    a, b, e = inst("a", 0.1, 1), inst("b", 0.2, 1), inst("e", 0.2, 1)
    assert moves([a, b, e]) == [("a", "b"), ("e", "b")]


def test_kv_readings_give_the_previous_check() -> None:
    readings = KvReadings()
    a = inst("a", 0.5, 2)
    readings.record([a])
    assert readings.previous() == {"a": 0.5}
    readings.forget("a")
    assert readings.previous() == {}


def test_plan_cycle_interrupts_the_source_routes_to_the_destination_and_pulls_the_freed_one() -> None:
    src, dest = inst("src", 0.1, 1), inst("dest", 0.4, 2)
    on = {t: PendingTrajectory(t, f"g-{t}", 0, 500) for t in src.running + dest.running}
    config = StrategyConfig(migration=MigrationMode.REPACK, repack_batch=8, sync=SyncMode.SELECTIVE)
    plan = plan_cycle([src, dest], [], ps_version=1, admission={0: 0, 1: 0}, config=config, on_instances=on,
                      repack_previous=falling(src, dest))
    assert [(m.source, m.destination) for m in plan.repacks] == [("src", "dest")]
    assert plan.interrupts == {"src": ["src-r0"]}
    assert [(d.instance_id, d.traj_id, d.v_traj, d.reserves_group) for d in plan.routes] == [("dest", "src-r0", 0, False)]
    assert plan.syncs == ["src"], "the freed source pulls the newest version at once"
    # not a repack check, or repack off: nothing moves
    assert plan_cycle([src, dest], [], 1, {0: 0, 1: 0}, config, on).repacks == []
    off = StrategyConfig(migration=MigrationMode.STARVED, repack_batch=8)
    assert plan_cycle([src, dest], [], 1, {0: 0, 1: 0}, off, on, repack_previous=falling(src, dest)).repacks == []


def test_migration_modes_map_onto_balance_and_repack() -> None:
    assert [(m.balance, m.repacks) for m in MigrationMode] == [
        (MigrationMode.STARVED, False), (MigrationMode.THROUGHPUT, False), (MigrationMode.NONE, True),
        (MigrationMode.THROUGHPUT, True), (MigrationMode.STARVED, True), (MigrationMode.NONE, False)]
    assert StrategyConfig().migration is MigrationMode.THROUGHPUT


instance_sets = st.lists(
    st.tuples(st.integers(0, 2), st.floats(0.0, 1.0), st.integers(0, 12), st.floats(-0.2, 0.2)),
    min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(instance_sets, st.integers(2, 12), st.floats(0.3, 1.0))
def test_plans_keep_groups_fit_and_free_at_least_one_when_any_move_fits(
        specs: list[tuple[int, float, int, float]], batch: int, share: float) -> None:
    config = StrategyConfig(migration=MigrationMode.REPACK, repack_batch=batch, repack_kv_share=share)
    insts = [inst(f"i{k}", usage, n, version=v) for k, (v, usage, n, _) in enumerate(specs)]
    previous = {f"i{k}": usage + delta for k, (_, usage, _, delta) in enumerate(specs)}
    by_id = {i.instance_id: i for i in insts}
    plan = plan_repack(insts, previous, config)
    sources = [m.source for m in plan]
    assert len(sources) == len(set(sources)), "a source is emptied once"
    load = {i.instance_id: (i.kv_usage or 0.0, len(i.trajectories)) for i in insts}
    for m in plan:
        s, d = by_id[m.source], by_id[m.destination]
        assert s.version == d.version, "a move stays in its version group"
        assert m.destination not in sources
        assert m.trajectories == tuple(s.trajectories)
        kv, n = load[m.destination]
        load[m.destination] = (kv + load[m.source][0], n + load[m.source][1])
    for d in {m.destination for m in plan}:
        assert load[d][0] <= share + 1e-9 and load[d][1] <= batch, "never overfilled"
    candidates = [i for i in insts if ramping_down(i, previous[i.instance_id], config)]
    fits = any(s is not d and s.version == d.version and (s.kv_usage or 0) + (d.kv_usage or 0) <= share
               and len(s.trajectories) + len(d.trajectories) <= batch for s in candidates for d in candidates)
    assert len(plan) >= (1 if fits else 0), "frees at least as many instances as any single move"
