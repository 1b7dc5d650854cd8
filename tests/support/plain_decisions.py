"""Plain decision passes, the references the vectorised ones are checked against: a router
written straight from Algorithms 2 and 3 (one trajectory at a time, one instance at a time, with
``CostModel.marginal_gain``), the decision pass around it as first written (every instance
copied, every step asking the waiting trajectories afresh), and random states to run them on."""

from __future__ import annotations

from hypothesis import strategies as st

from staleflow.config.strategy import RoutingMode, StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.strategies import InstanceState, PendingTrajectory
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
        if v is None:
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


def plain_plan_cycle(instances, pending, ps_version, admission, config, on_instances=None, repack_previous=None):
    """``plan_cycle`` as first written: every instance copied up front, sync, migration and repack
    each asking the waiting trajectories afresh, and the straightforward router."""
    from staleflow.strategies import AdmissionBudget, CyclePlan, plan_migrations, plan_syncs
    from staleflow.strategies.plan import _keep_in_place, _repack, held_kept_pulls, keeps_running
    from staleflow.strategies.routing import reachable
    from staleflow.strategies.sync import Routable

    states = {inst.instance_id: inst.copy() for inst in instances}
    budget = AdmissionBudget(dict(admission))
    on_instances = on_instances or {}
    group_versions: dict[str, int] = {}
    waiting = reachable(pending, budget, group_versions)
    plan = CyclePlan()

    def hand_back(inst, traj_ids):
        plan.interrupts.setdefault(inst.instance_id, []).extend(traj_ids)
        share = inst.kv_cache / len(inst.running) / inst.cost.k5 if inst.running else 0.0
        running = set(inst.running)
        for traj_id in traj_ids:
            known = on_instances.get(traj_id)
            if known is not None:
                length = max(known.length, int(share)) if traj_id in running else known.length
                waiting.append(PendingTrajectory(traj_id, known.group_id, known.v_traj, length, known.seq,
                                                     known.remaining))
        inst.discard(set(traj_ids))

    plan.syncs = plan_syncs(list(states.values()), waiting, ps_version, budget, config, group_versions)
    plan.kept = keeps_running(plan.syncs, instances, config)
    held = held_kept_pulls(instances, plan.syncs, ps_version, config)
    plan.syncs += held
    plan.kept += held
    pinned = []
    for instance_id in plan.syncs:
        inst = states[instance_id]
        if instance_id in plan.kept:
            inst.version = ps_version
            continue
        if config.pin_partials:
            if inst.trajectories:
                plan.interrupts[instance_id] = inst.trajectories
            pinned += [RouteDecision(instance_id, t, known.group_id, known.v_traj, False)
                       for t in inst.trajectories if (known := on_instances.get(t)) is not None
                       and known.v_traj is not None]
            inst.version = ps_version
            continue
        if inst.trajectories:
            hand_back(inst, inst.trajectories)
        inst.version = ps_version
        inst.kv_cache = 0.0
        inst.kv_usage = None if inst.kv_usage is None else 0.0
    migrated = {}
    for instance_id, traj_ids in plan_migrations(list(states.values()), config, waiting, budget,
                                                 group_versions).items():
        hand_back(states[instance_id], traj_ids)
        migrated.update(dict.fromkeys(traj_ids, instance_id))
    if repack_previous is not None and config.migration.repacks:
        routable = Routable(waiting, group_versions)
        idle = [s for s in states.values() if s.instance_id not in plan.syncs and not routable.on(s, budget)]
        pinned += _repack(plan, states.__getitem__, idle, repack_previous, on_instances, ps_version, config)
    plan.routes = pinned + straightforward_route(list(states.values()), waiting, budget, config, group_versions)
    if migrated:
        _keep_in_place(plan, migrated, set(plan.kept))
    return plan


@st.composite
def snapshots(draw):
    """A coordinator cycle's inputs: instances at mixed versions (some lagging the newest), what
    runs and waits on them (known to the trajectory server, so that handed-back ones route again),
    groups waiting in the trajectory server, the ledger's admission, and a KV reading of a repack
    check."""
    ps_version = draw(st.integers(0, 3))
    cost = draw(st.sampled_from(COSTS))
    instances, on_instances, seq = [], {}, 1000
    for i in range(draw(st.integers(1, 8))):
        running = [f"i{i}-r{k}" for k in range(draw(st.sampled_from([0, 0, draw(st.integers(1, 30))])))]
        waiting = [f"i{i}-w{k}" for k in range(draw(st.sampled_from([0, 0, 0, 2, 5])))]
        version = draw(st.integers(max(0, ps_version - 2), ps_version))
        kv = draw(st.floats(0, cost.kv_budget)) if running else 0.0
        instances.append(InstanceState(f"i{i}", version, kv, running, waiting, cost,
                                       speed=draw(st.sampled_from([1.0, 1.0, 0.5, 2.0])),
                                       kv_usage=kv / cost.kv_budget))
        for t in running + waiting:
            seq += 1
            on_instances[t] = PendingTrajectory(t, f"{t}-group", draw(st.integers(max(0, version - 1), version)),
                                                draw(st.integers(1, 20_000)), seq)
    pending = []
    for g in range(draw(st.integers(0, 10))):
        partial = draw(st.booleans())
        shared = draw(st.integers(1, 20_000))
        for m in range(draw(st.sampled_from([1, 4, 16]))):
            v = draw(st.integers(0, ps_version)) if partial else None
            pending.append(PendingTrajectory(f"g{g}-{m}", f"g{g}", v, shared if not partial else
                                             draw(st.integers(1, 20_000)), draw(st.integers(0, 500))))
    admission = {v: draw(st.integers(0, 6)) for v in range(ps_version + 1)}
    repack_previous = {inst.instance_id: draw(st.floats(0, 1)) for inst in instances} if draw(st.booleans()) else None
    return instances, pending, ps_version, admission, on_instances, repack_previous
