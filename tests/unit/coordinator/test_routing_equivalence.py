"""The vectorised router (one gain evaluation for the whole fleet, a run of same-length
trajectories routed in one loop, runs of withheld trajectories tested at once, -inf gains where
something waits) decides exactly like a straightforward one written from Algorithms 2 and 3: one
trajectory at a time, one instance at a time, with ``CostModel.marginal_gain`` (times the
instance's decode speed when routing by speed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.config.strategy import RoutingMode, StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.strategies import AdmissionBudget, InstanceState, PendingTrajectory, route
from staleflow.strategies.routing import SPEED_TOLERANCE, RouteDecision

COSTS = (CostModel(kv_budget=60_000), CostModel(kv_budget=20_000, k5=0.5), CostModel(k1=2e-7, kv_budget=200_000))


def straightforward_route(instances, pending, budget, config, group_versions) -> list[RouteDecision]:
    by_version: dict[int, list[InstanceState]] = {}
    for inst in instances:
        by_version.setdefault(inst.version, []).append(inst.copy())
    groups = sorted(by_version.items())
    budget = budget.copy()
    versions = dict(group_versions)
    levels: dict[int, list[PendingTrajectory]] = {}
    initial: dict[str, list[PendingTrajectory]] = {}
    for t in sorted(pending, key=lambda t: t.seq):
        v = t.v_traj if t.v_traj is not None else versions.get(t.group_id)
        (initial.setdefault(t.group_id, []) if v is None else levels.setdefault(v, [])).append(t)
    in_flight = sum(len(i.running) + len(i.waiting) for i in instances)
    withheld, decisions = False, []

    def speed(inst: InstanceState) -> float:
        return inst.speed if config.route_by_speed and abs(inst.speed - 1.0) > SPEED_TOLERANCE else 1.0

    def best_of(insts, length):  # the first instance with the largest gain
        gains = [i.marginal_gain(length) * speed(i) for i in insts]
        k = gains.index(max(gains))
        return k, gains[k]

    while True:
        while levels and not levels[min(levels)]:
            del levels[min(levels)]
            if withheld:
                return decisions
        if levels:
            v = min(levels)
            traj = levels[v][0]
        elif initial and not withheld:
            v, traj = None, next(iter(initial.values()))[0]
        else:
            return decisions
        if config.max_in_flight is not None and in_flight >= config.max_in_flight:
            return decisions
        if v is None:
            candidates = [(gv, insts) for gv, insts in groups if budget.allows(gv)]
            if config.order_by_reserve:
                admissible = budget.as_dict()
                candidates.sort(key=lambda g: (admissible.get(g[0], 0), g[0]))
        else:
            candidates = [(gv, insts) for gv, insts in groups if gv >= v]
        if not candidates:
            return decisions
        chosen = None
        if config.routing is RoutingMode.VANILLA:
            fewest = float("inf")
            for gv, insts in candidates:
                counts = [len(i.running) + len(i.waiting) for i in insts]
                k = counts.index(min(counts))
                if counts[k] < fewest:
                    chosen, fewest = (gv, insts[k]), counts[k]
        elif v is not None and config.versioned_by_gain:
            top = -1.0
            for gv, insts in candidates:
                k, gain = best_of(insts, traj.length)
                if gain >= config.mu * insts[k].cost.ideal_gain(traj.length) and gain > top:
                    chosen, top = (gv, insts[k]), gain
        else:
            for gv, insts in candidates:
                k, gain = best_of(insts, traj.length)
                if gain >= config.mu * insts[k].cost.ideal_gain(traj.length):
                    chosen = (gv, insts[k])
                    break
        if chosen is None:
            if v is None or not config.scan_withheld:
                return decisions
            levels[v].pop(0)
            withheld = True
            continue
        gv, target = chosen
        reserves = v is None
        if reserves:
            initial[traj.group_id].pop(0)
            v = gv
            budget.take(v)
            versions[traj.group_id] = v
            levels.setdefault(v, []).extend(initial.pop(traj.group_id))
        else:
            levels[v].pop(0)
        target.add(traj.traj_id, traj.length)
        in_flight += 1
        decisions.append(RouteDecision(target.instance_id, traj.traj_id, traj.group_id, v, reserves))


@st.composite
def routing_states(draw):
    n_instances = draw(st.integers(1, 10))
    one_cost = draw(st.sampled_from([None, *COSTS]))  # a fleet of one cost model routes on scalar coefficients
    instances = []
    for i in range(n_instances):
        cost = one_cost or draw(st.sampled_from(COSTS))
        running = draw(st.sampled_from([0, 0, draw(st.integers(1, 40))]))  # idle ones tie: the first wins
        kv = draw(st.floats(0, cost.kv_budget * 1.1)) if running else 0.0
        instances.append(InstanceState(f"i{i}", draw(st.sampled_from([0, 0, 1, 2, 3])), kv, [f"i{i}-r{k}" for k in range(running)],
                                       [f"i{i}-w{k}" for k in range(draw(st.sampled_from([0, 0, 0, 2])))], cost,
                                       speed=draw(st.sampled_from([1.0, 1.0, 1.05, 0.5, 2.0, 0.0]))))
    pending = []
    group_versions = {}
    for g in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["initial", "reserved", "partial"]))
        if kind == "reserved":
            group_versions[f"g{g}"] = draw(st.integers(0, 3))
        # members of a group share their prompt: runs of one length; or each its own length
        shared = draw(st.sampled_from([None, draw(st.integers(1, 40_000))]))
        for m in range(draw(st.sampled_from([1, 2, 6, 16]))):
            v = draw(st.integers(0, 3)) if kind == "partial" else None
            pending.append(PendingTrajectory(f"g{g}-{m}", f"g{g}", v, shared or draw(st.integers(1, 40_000)),
                                             draw(st.integers(0, 200))))
    admission = {v: draw(st.integers(0, 6)) for v in range(4)}
    config = StrategyConfig(
        routing=draw(st.sampled_from(RoutingMode)), mu=draw(st.sampled_from([0.0, 0.05, 0.3, 0.9])),
        scan_withheld=draw(st.booleans()), versioned_by_gain=draw(st.booleans()),
        order_by_reserve=draw(st.booleans()), max_in_flight=draw(st.sampled_from([None, None, 60, 200])),
        route_by_speed=draw(st.booleans()))
    return instances, pending, admission, group_versions, config


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
