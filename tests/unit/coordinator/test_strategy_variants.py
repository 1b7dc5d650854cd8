"""The authors' strategy variants (load-aware sync, starved migration, the routing scan, pinned
partials) and the completion-order ledger, on hand-built states and random ones (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.manager import LedgerParams
from staleflow.config.strategy import MigrationMode, StrategyConfig, SyncMode
from staleflow.cost_model import CostModel
from staleflow.ledger import LedgerError
from staleflow.simulation.cluster import straggler_slowdowns
from staleflow.simulation.completion_order import CompletionOrderLedger
from staleflow.simulation.hardware import H20, QWEN3_30B_A3B, QWEN3_32B, RolloutInstance
from staleflow.strategies import AdmissionBudget, InstanceState, PendingTrajectory, plan_cycle, plan_migrations, plan_syncs, route

COST = CostModel(kv_budget=100_000)
LOAD_AWARE = StrategyConfig(sync=SyncMode.LOAD_AWARE)
STARVED = StrategyConfig(migration=MigrationMode.STARVED, migration_min_trajectories=8)


def inst(name: str, version: int = 0, running: int = 0, waiting: int = 0, kv: float | None = None) -> InstanceState:
    return InstanceState(name, version, float(kv if kv is not None else 1000 * running),
                         [f"{name}-r{i}" for i in range(running)], [f"{name}-w{i}" for i in range(waiting)], COST)


# ---------------------------------------------------------------------- load-aware sync


def test_load_aware_sync_waits_for_low_kv_and_an_empty_queue() -> None:
    idle = inst("idle", running=2, kv=10_000)
    busy = inst("busy", running=60, kv=80_000)
    queued = inst("queued", running=2, waiting=1, kv=10_000)
    current = inst("current", version=1)
    new_group = [PendingTrajectory("n-0", "n", None, 200)]
    assert plan_syncs([idle, busy, queued, current], new_group, 1, AdmissionBudget({0: 9, 1: 9}), LOAD_AWARE) == ["idle"]


def test_load_aware_sync_holds_while_a_versioned_trajectory_could_still_run_here() -> None:
    lagging = inst("lagging", version=1)
    partial = [PendingTrajectory("p", "g", 1, 5_000)]
    assert plan_syncs([lagging], partial, 2, AdmissionBudget({}), LOAD_AWARE) == []
    older_partial = [PendingTrajectory("p", "g", 2, 5_000)]  # needs version 2: syncing lets it run
    assert plan_syncs([lagging], older_partial, 2, AdmissionBudget({}), LOAD_AWARE) == ["lagging"]


def test_never_sync_keeps_every_instance_on_its_weights() -> None:
    config = StrategyConfig(sync=SyncMode.NEVER)
    assert plan_syncs([inst("a"), inst("b")], [], 5, AdmissionBudget({}), config) == []


# ---------------------------------------------------------------------- starved migration


def test_starved_migration_feeds_an_idle_instance_from_the_busiest_no_newer_one() -> None:
    starved, busy, busier = inst("starved"), inst("busy", running=10), inst("busier", running=40)
    newer = inst("newer", version=1, running=80)  # its trajectories could not run on the starved instance
    moves = plan_migrations([starved, busy, busier, newer], STARVED, [], AdmissionBudget({0: 0, 1: 0}))
    assert list(moves) == ["busier"] and len(moves["busier"]) == 40


def test_starved_migration_stops_below_its_floor_and_when_work_waits() -> None:
    starved, small = inst("starved"), inst("small", running=5)
    assert plan_migrations([starved, small], STARVED, [], AdmissionBudget({})) == {}
    big = inst("big", running=30)
    waiting_work = [PendingTrajectory("n-0", "n", None, 200)]
    assert plan_migrations([starved, big], STARVED, waiting_work, AdmissionBudget({0: 4})) == {}, "not starved"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=8),
       st.integers(1, 12))
def test_starved_migration_moves_at_most_one_whole_instance_plus_queue_excess(
        shape: list[tuple[int, int, int]], floor: int) -> None:
    states = [inst(f"i{k}", v, r, w) for k, (v, r, w) in enumerate(shape)]
    config = StrategyConfig(migration=MigrationMode.STARVED, migration_min_trajectories=floor)
    moves = plan_migrations(states, config, [], AdmissionBudget({}))
    by_id = {s.instance_id: s for s in states}
    whole = [i for i, ids in moves.items() if len(ids) > max(0, len(by_id[i].waiting) - config.phi_wait)]
    assert len(whole) <= 1
    for i in whole:
        assert set(moves[i]) == set(by_id[i].trajectories) and len(moves[i]) >= floor
    for i, ids in moves.items():
        assert len(ids) == len(set(ids)) and set(ids) <= set(by_id[i].trajectories)


# ---------------------------------------------------------------------- routing


def test_routing_scans_past_a_withheld_trajectory_within_its_level() -> None:
    nearly_full = inst("full", running=10, kv=95_000)
    long_then_short = [PendingTrajectory("long", "g1", 0, 20_000, 1), PendingTrajectory("short", "g2", 0, 1_000, 2)]
    scanning = route([nearly_full], long_then_short, AdmissionBudget({}), StrategyConfig(mu=0.01))
    assert [d.traj_id for d in scanning] == ["short"]
    stopping = route([nearly_full], long_then_short, AdmissionBudget({}), StrategyConfig(mu=0.01, scan_withheld=False))
    assert stopping == []


def test_a_withheld_level_ends_the_pass_before_newer_levels() -> None:
    nearly_full = inst("full", version=1, running=10, kv=95_000)
    pending = [PendingTrajectory("stale-long", "g1", 0, 20_000, 1), PendingTrajectory("newer", "g2", 1, 500, 2)]
    assert route([nearly_full], pending, AdmissionBudget({}), StrategyConfig(mu=0.01)) == []


def test_without_migration_a_sync_routes_the_instance_own_trajectories_back_to_it() -> None:
    lagging = inst("a", version=0, running=3)
    other = inst("b", version=1)
    on_instances = {t: PendingTrajectory(t, f"g{k}", 0, 2_000, k) for k, t in enumerate(lagging.trajectories)}
    config = StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE, pin_partials=True)
    plan = plan_cycle([lagging, other], [], 1, {1: 0}, config, on_instances)
    assert plan.syncs == ["a"] and set(plan.interrupts["a"]) == set(lagging.trajectories)
    assert {(d.traj_id, d.instance_id) for d in plan.routes} == {(t, "a") for t in lagging.trajectories}
    free = plan_cycle([lagging, other], [], 1, {1: 0}, StrategyConfig(sync=SyncMode.GREEDY), on_instances)
    assert {d.traj_id for d in free.routes} == set(lagging.trajectories)
    assert len({d.instance_id for d in free.routes}) == 2, "pinning off: routing spreads them over both instances"


# ---------------------------------------------------------------------- completion-order ledger


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(1, 6), st.lists(st.sampled_from(["reserve", "occupy", "consume"]), max_size=80))
def test_completion_order_counter_never_admits_past_eta_plus_version_batches(
        eta: int, batch: int, ops: list[str]) -> None:
    ledger = CompletionOrderLedger(LedgerParams(eta, batch))
    reserved: list[str] = []
    completed: list[str] = []
    n = 0
    for op in ops:
        if op == "reserve":
            free = ledger.admission()[ledger.train_version]
            try:
                ledger.reserve(f"g{n}", ledger.train_version)
                reserved.append(f"g{n}")
                assert free > 0
            except LedgerError:
                assert free == 0
            n += 1
        elif op == "occupy" and reserved:
            gid = reserved.pop(len(reserved) // 2)  # groups complete out of order
            ledger.occupy(gid)
            completed.append(gid)
        elif op == "consume":
            try:
                taken = ledger.consume().consumed
                assert taken == completed[:batch], "the first B groups to complete, in completion order"
                completed = completed[batch:]
            except LedgerError:
                assert len(completed) < batch
        assert ledger.started <= (eta + ledger.train_version + 1) * batch


def test_unbounded_completion_order_admits_whatever_the_pool_holds() -> None:
    ledger = CompletionOrderLedger(LedgerParams(0, 2), bounded=False)
    for k in range(50):
        ledger.reserve(f"g{k}", 0)
    assert min(ledger.admission().values()) > 10**9


# ---------------------------------------------------------------------- hardware and stragglers


def test_instances_derived_from_hardware() -> None:
    moe = RolloutInstance(H20, QWEN3_30B_A3B)
    assert moe.model.kv_bytes_per_token == 98_304
    assert 200_000 < moe.kv_tokens < 240_000, "one H20 at 0.9 utilisation holds about 220K tokens"
    assert moe.cost_model().k5 == 1 and moe.cost_model().k1 == 7.28e-8, "Table 4, per token"
    dense = RolloutInstance(H20, QWEN3_32B, tp=2)
    assert dense.model.kv_bytes_per_token == 262_144 and 350_000 < dense.kv_tokens < 420_000
    single = RolloutInstance(H20, QWEN3_32B, tp=1)
    assert single.kv_tokens < 80_000, "TP1 would leave a 32B dense model little KV"
    assert dense.cost_model().k3 > moe.cost_model().k3, "a dense 32B computes ten times the active weights"


def test_straggler_speeds_are_persistent_seeded_and_spread_by_sigma() -> None:
    assert straggler_slowdowns(8, 0.0, 1) == [1.0] * 8
    narrow, wide = straggler_slowdowns(64, 0.1, 3), straggler_slowdowns(64, 0.25, 3)
    assert narrow == straggler_slowdowns(64, 0.1, 3), "same seed, same instances"
    assert max(wide) / min(wide) > max(narrow) / min(narrow) > 1
    speeds = [1 / f for f in wide]
    assert abs(sum(speeds) / len(speeds) - 1) < 0.1, "mean speed about 1"
