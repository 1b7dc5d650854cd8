"""Coordination strategies on hand-built snapshots (paper §5.3, Appendix D)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.manager import LedgerParams
from staleflow.config.strategy import MigrationMode, PullMode, RoutingMode, StrategyConfig, SyncMode
from staleflow.cost_model import CostModel
from staleflow.ledger import Ledger, LedgerError
from staleflow.strategies import (
    AdmissionBudget,
    InstanceState,
    PendingTrajectory,
    SpeculativeState,
    plan_cycle,
    plan_migrations,
    plan_syncs,
    route,
)

COST = CostModel(kv_budget=100_000)


def inst(name: str, version: int = 0, running: int = 0, waiting: int = 0, kv: float | None = None) -> InstanceState:
    return InstanceState(
        name, version, float(kv if kv is not None else 1000 * running),
        [f"{name}-r{i}" for i in range(running)], [f"{name}-w{i}" for i in range(waiting)], COST,
    )


def initial(group: str, members: int = 1, length: int = 200, seq: int = 0) -> list[PendingTrajectory]:
    return [PendingTrajectory(f"{group}-{m}", group, None, length, seq + m) for m in range(members)]


def test_initial_trajectory_admitted_only_at_a_newer_version() -> None:
    old, new = inst("old", version=0), inst("new", version=1, running=20)
    budget = AdmissionBudget({0: 0, 1: 4})  # version 0 would break the bound; version 1 is fine
    decisions = route([old, new], initial("g"), budget, StrategyConfig())
    assert [(d.instance_id, d.v_traj, d.reserves_group) for d in decisions] == [("new", 1, True)]


def test_partial_trajectory_resumes_only_on_a_new_enough_instance() -> None:
    stale_idle, fresh_busy = inst("stale", version=0), inst("fresh", version=2, running=10)
    partial = PendingTrajectory("p", "g", 1, 900)
    decisions = route([stale_idle, fresh_busy], [partial], AdmissionBudget({}), StrategyConfig())
    assert [(d.instance_id, d.v_traj, d.reserves_group) for d in decisions] == [("fresh", 1, False)]
    assert route([stale_idle], [partial], AdmissionBudget({}), StrategyConfig()) == []


def test_waterfall_prefers_older_versions_then_withholds() -> None:
    older, newer = inst("older", version=0), inst("newer", version=1)
    budget = AdmissionBudget({0: 1000, 1: 1000})
    decisions = route([newer, older], initial("g", members=400), budget, StrategyConfig())
    counts = {i: sum(d.instance_id == i for d in decisions) for i in ("older", "newer")}
    assert counts["older"] > 0, "the older-version group is tried first"
    # the older instance keeps taking work until its marginal gain drops below mu x ideal
    first_newer = next(k for k, d in enumerate(decisions) if d.instance_id == "newer")
    assert all(d.instance_id == "older" for d in decisions[:first_newer])
    assert len(decisions) < 400, "once no instance clears mu x ideal, the rest is withheld"
    assert all(d.v_traj == 0 for d in decisions if d.instance_id == "older")


def test_group_members_follow_the_group_version() -> None:
    a, b = inst("a", version=0), inst("b", version=1)
    budget = AdmissionBudget({0: 1, 1: 1})
    decisions = route([a, b], initial("g", members=3), budget, StrategyConfig(mu=0.0))
    assert [d.reserves_group for d in decisions] == [True, False, False]
    assert {d.v_traj for d in decisions} == {decisions[0].v_traj}
    assert all(d.instance_id in ("a", "b") for d in decisions)


def test_stalest_trajectories_are_routed_first() -> None:
    busy = inst("i", version=2)
    pending = [*initial("fresh", length=50, seq=0), PendingTrajectory("v2", "h", 2, 50, 1),
               PendingTrajectory("v1", "k", 1, 50, 2)]
    decisions = route([busy], pending, AdmissionBudget({2: 5}), StrategyConfig(mu=0.0))
    assert [d.traj_id for d in decisions] == ["v1", "v2", "fresh-0"]


def test_vanilla_routing_balances_counts_without_a_threshold() -> None:
    a, b = inst("a", running=3), inst("b", running=1)
    decisions = route([a, b], initial("g", members=4), AdmissionBudget({0: 10}), StrategyConfig(routing=RoutingMode.VANILLA))
    assert [d.instance_id for d in decisions] == ["b", "b", "a", "b"]


def test_sync_skipped_when_nothing_would_be_routed() -> None:
    lagging = inst("lag", version=0, running=2)
    # only a partial of version 0 waits: it can still run on the lagging instance, so no sync
    partial = [PendingTrajectory("p", "g", 0, 100)]
    assert plan_syncs([lagging], partial, 1, AdmissionBudget({0: 0, 1: 4}), StrategyConfig()) == []
    # nothing waits at all: a tentative update would route nothing
    assert plan_syncs([lagging], [], 1, AdmissionBudget({0: 4, 1: 4}), StrategyConfig()) == []


def test_sync_when_only_a_newer_version_unlocks_work() -> None:
    lagging, current = inst("lag", version=0), inst("cur", version=1, running=150, kv=90_000)
    pending = initial("g", members=2)
    budget = AdmissionBudget({0: 0, 1: 4})  # version-0 groups no longer fit under eta
    assert plan_syncs([lagging, current], pending, 1, budget, StrategyConfig()) == ["lag"]
    greedy = StrategyConfig(sync=SyncMode.GREEDY)
    assert plan_syncs([lagging, current], [], 1, budget, greedy) == ["lag"], "greedy syncs regardless"


def test_migration_moves_excess_waiting_and_relieves_the_busiest() -> None:
    config = StrategyConfig(phi_wait=3, phi_throughput=5)
    crowded = inst("crowded", running=4, waiting=5)
    assert plan_migrations([crowded, inst("peer", running=4)], config) == {"crowded": ["crowded-w3", "crowded-w4"]}
    busy, idle = inst("busy", running=6), inst("idle")
    assert sorted(plan_migrations([busy, idle], config)["busy"]) == sorted(busy.trajectories)
    # one trajectory gains nothing from moving; an older peer cannot take the trajectories
    assert plan_migrations([inst("one", running=1), inst("idle")], config) == {}
    assert plan_migrations([inst("new", version=2, running=6), inst("old", version=1)], config) == {}
    assert plan_migrations([busy, idle], StrategyConfig(migration=MigrationMode.NONE)) == {}


def test_plan_cycle_reroutes_what_sync_interrupts() -> None:
    lagging = inst("lag", version=0, running=2, kv=400)
    fresh = inst("fresh", version=1)
    on_instances = {t: PendingTrajectory(t, "g", 0, 150) for t in lagging.running}
    plan = plan_cycle([lagging, fresh], initial("n", members=1), ps_version=1, admission={0: 0, 1: 4},
                      config=StrategyConfig(sync=SyncMode.GREEDY), on_instances=on_instances)
    assert plan.syncs == ["lag"]
    assert sorted(plan.interrupts["lag"]) == sorted(lagging.running)
    routed = {d.traj_id: d for d in plan.routes}
    assert set(lagging.running) <= set(routed), "interrupted partials are routed again in the same pass"
    assert all(routed[t].v_traj == 0 and not routed[t].reserves_group for t in lagging.running)


def test_a_pull_that_keeps_the_trajectories_leaves_them_and_their_load_where_they_are() -> None:
    """The cost model sees the synced instance as it will be: at the new version, still running
    its trajectories with their KV cache; nothing is interrupted or routed anew for the Pull."""
    lagging = inst("lag", version=0, running=2, kv=40_000)
    fresh = inst("fresh", version=1)
    on_instances = {t: PendingTrajectory(t, "g", 0, 20_000) for t in lagging.running}
    keep = StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE, pull=PullMode.KEEP)
    new_group = initial("n", members=2, length=200)
    plan = plan_cycle([lagging, fresh], new_group, ps_version=1, admission={0: 0, 1: 4}, config=keep,
                      on_instances=on_instances)
    assert plan.syncs == ["lag"] and plan.interrupts == {}
    assert not {d.traj_id for d in plan.routes} & set(lagging.running)
    # the new group goes where the load is: to the empty instance, not to the one still full of KV
    assert {d.instance_id for d in plan.routes} == {"fresh"}
    interrupting = plan_cycle([lagging, fresh], new_group, ps_version=1, admission={0: 0, 1: 4},
                              config=StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE),
                              on_instances=on_instances)
    assert sorted(interrupting.interrupts["lag"]) == sorted(lagging.running)


def test_a_migrated_trajectory_routed_back_to_its_instance_stays_there() -> None:
    busy, peer = inst("busy", running=6, kv=1200), inst("peer", running=1, kv=200)
    on_instances = {t: PendingTrajectory(t, "g", 0, 200) for t in busy.running + peer.running}
    config = StrategyConfig(mu=0.0, phi_throughput=1.0)  # migrate the busiest, route wherever the gain is
    plan = plan_cycle([busy, peer], [], ps_version=0, admission={0: 0}, config=config, on_instances=on_instances)
    moved = {d.traj_id: d.instance_id for d in plan.routes}
    assert all(where != "busy" for where in moved.values()), "nothing is interrupted only to come back"
    assert sorted(plan.interrupts.get("busy", [])) == sorted(moved), "only what moves is interrupted"
    assert moved, "some trajectories still move to the peer"


def test_versioned_trajectories_by_gain_skip_the_version_waterfall() -> None:
    old, new = inst("old", version=0, running=40, kv=40_000), inst("new", version=1)
    partials = [PendingTrajectory(f"p{k}", "g", 0, 900, k) for k in range(3)]
    paper = route([old, new], partials, AdmissionBudget({}), StrategyConfig(mu=0.0, versioned_by_gain=False))
    assert {d.instance_id for d in paper} == {"old"}, "Algorithm 3 as printed: the oldest version group first"
    by_gain = route([old, new], partials, AdmissionBudget({}), StrategyConfig(mu=0.0))  # the default
    assert {d.instance_id for d in by_gain} == {"new"}, "the larger marginal gain, at any admissible version"
    # initial trajectories keep the waterfall (the version they get is the staleness they carry)
    fresh = route([old, new], initial("n"), AdmissionBudget({0: 4, 1: 4}), StrategyConfig(mu=0.0))
    assert [d.instance_id for d in fresh] == ["old"]


def test_speculative_state_follows_table1_and_eq1() -> None:
    p = SpeculativeState()
    p.track("i")
    p.routed("i", 3)
    assert not p.validates("i", 0, {"a", "b"}, set(), set()), "a route has not landed yet"
    assert p.validates("i", 0, {"a"}, {"b"}, {"c"})
    p.removed("i", 1)
    assert p.validates("i", 0, {"a"}, set(), {"c"})
    p.pulled("i", 2)
    assert not p.validates("i", 0, set(), set(), set()), "the Pull has not landed yet"
    assert p.validates("i", 2, set(), set(), set())


@given(
    eta=st.integers(0, 3),
    batch=st.integers(1, 6),
    prior=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=20),
    versions=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    groups=st.integers(0, 30),
    routing=st.sampled_from(list(RoutingMode)),
)
@settings(max_examples=200, deadline=None)
def test_ledger_never_refuses_what_admission_allowed(
    eta: int, batch: int, prior: list[tuple[int, bool]], versions: list[int], groups: int, routing: RoutingMode
) -> None:
    """The plan reserves groups only where the ledger's one-per-cycle admission answer said so."""
    ledger = Ledger(LedgerParams(eta=eta, batch_size=batch))
    for step in range(3):  # advance the trainer a little
        for i in range(batch):
            ledger.reserve(f"warm{step}-{i}", ledger.train_version)
            ledger.occupy(f"warm{step}-{i}")
        ledger.consume()
    t = ledger.train_version
    for k, (back, occupy) in enumerate(prior):
        v = max(0, t - back)
        try:
            ledger.reserve(f"prior{k}", v)
            if occupy:
                ledger.occupy(f"prior{k}")
        except LedgerError:
            pass
    instances = [inst(f"i{k}", version=max(0, t - v)) for k, v in enumerate(versions)]
    pending = [p for g in range(groups) for p in initial(f"g{g}", members=2, seq=2 * g)]
    plan = plan_cycle(instances, pending, ps_version=t, admission=ledger.admission(),
                      config=StrategyConfig(routing=routing, mu=0.1))
    for decision in plan.routes:
        if decision.reserves_group:
            ledger.reserve(decision.group_id, decision.v_traj)  # must not raise
    assert all(ledger.entry(d.group_id).v_traj == d.v_traj for d in plan.routes)
