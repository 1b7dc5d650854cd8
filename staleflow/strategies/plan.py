"""One decision pass of the snapshot-command cycle (paper Algorithm 1): synchronization, then
migration, then repack (on a repack check), then routing, each seeing the effects of the ones
before it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from staleflow.config.strategy import PullMode, StrategyConfig, SyncMode
from staleflow.strategies.migration import plan_migrations
from staleflow.strategies.repack import RepackMove, plan_repack
from staleflow.strategies.routing import RouteDecision, reachable, route
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory
from staleflow.strategies.sync import Routable, plan_syncs


@dataclass
class CyclePlan:
    syncs: list[str] = field(default_factory=list[str])  # Pull (unless kept: Interrupt everything on them first)
    kept: list[str] = field(default_factory=list[str])  # the syncs whose Pull keeps the trajectories and their KV
    interrupts: dict[str, list[str]] = field(default_factory=dict[str, list[str]])  # by instance, syncs' included
    routes: list[RouteDecision] = field(default_factory=list[RouteDecision])
    repacks: list[RepackMove] = field(default_factory=list[RepackMove])  # their Interrupts and Routes are in the above

    @property
    def empty(self) -> bool:
        return not (self.syncs or self.interrupts or self.routes)


def plan_cycle(
    instances: Sequence[InstanceState],
    pending: Sequence[PendingTrajectory],
    ps_version: int,
    admission: Mapping[int, int],
    config: StrategyConfig,
    on_instances: Mapping[str, PendingTrajectory] | None = None,
    group_versions: Mapping[str, int] | None = None,
    repack_previous: Mapping[str, float] | None = None,
) -> CyclePlan:
    """Decide the commands of one cycle from validated snapshots. Inputs are not modified.

    ``on_instances`` describes the trajectories currently on instances (group, V_traj, length
    when routed) so that interrupted ones can be routed again in the same pass; the Route waits
    for them to reach the trajectory server. ``admission`` is the ledger's answer for this cycle.
    """
    states = {inst.instance_id: inst for inst in instances}  # copied when a step changes one (``mutable``)
    copied: set[str] = set()

    def mutable(instance_id: str) -> InstanceState:
        if instance_id not in copied:
            copied.add(instance_id)
            states[instance_id] = states[instance_id].copy()
        return states[instance_id]

    budget = AdmissionBudget(dict(admission))
    on_instances = on_instances or {}
    group_versions = dict(group_versions or {})
    reached = len(waiting := reachable(pending, budget, group_versions))  # as many at routing: in arrival order
    routable = Routable(waiting, group_versions)  # kept current as trajectories are handed back
    plan = CyclePlan()

    def hand_back(inst: InstanceState, traj_ids: list[str]) -> None:
        plan.interrupts.setdefault(inst.instance_id, []).extend(traj_ids)
        share = inst.kv_cache / len(inst.running) / inst.cost.k5 if inst.running else 0.0
        running = set(inst.running)
        for traj_id in traj_ids:
            known = on_instances.get(traj_id)
            if known is None:
                continue  # unknown here: it returns to the trajectory server and waits a cycle
            length = max(known.length, int(share)) if traj_id in running else known.length
            waiting.append(back := PendingTrajectory(traj_id, known.group_id, known.v_traj, length, known.seq,
                                                     known.remaining))
            routable.include(back)
        inst.discard(set(traj_ids))

    syncs = plan_syncs(list(states.values()), waiting, ps_version, budget, config, group_versions, routable)
    plan.syncs, plan.kept = _with_held_kept_pulls(syncs, instances, ps_version, config)
    kept = set(plan.kept)
    pinned: list[RouteDecision] = []
    for instance_id in plan.syncs:
        inst = mutable(instance_id)
        if instance_id in kept:  # its trajectories, KV and load stay: only the version changes
            inst.version = ps_version
            continue
        if config.pin_partials:  # its trajectories come straight back after the Pull
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
    migrated: dict[str, str] = {}  # trajectory -> the instance a migration takes it from
    for instance_id, traj_ids in plan_migrations(list(states.values()), config, waiting, budget,
                                                 group_versions, routable).items():
        hand_back(mutable(instance_id), traj_ids)
        migrated.update(dict.fromkeys(traj_ids, instance_id))
    if repack_previous is not None and config.migration.repacks:
        idle = [s for s in states.values() if s.instance_id not in plan.syncs and not routable.on(s, budget)]
        pinned += _repack(plan, mutable, idle, repack_previous, on_instances, ps_version, config)
    plan.routes = pinned + route(states.values(), waiting, budget, config, group_versions, in_order=len(waiting) == reached)
    if migrated:
        _keep_in_place(plan, migrated, kept)
    return plan


def _repack(plan: CyclePlan, mutable: Callable[[str], InstanceState], idle: list[InstanceState],
            previous: Mapping[str, float], on_instances: Mapping[str, PendingTrajectory], ps_version: int,
            config: StrategyConfig) -> list[RouteDecision]:
    """Repack's moves among ``idle`` instances: an Interrupt of everything on each source and a
    Route of each trajectory to its destination. A freed source that lags the newest version Pulls
    it at once (Laminar's point: freed instances take new work on new weights).

    ``idle``: those not syncing in this pass that nothing waiting may run on. Laminar's ramp-down
    is a rollout whose batch has nothing left to admit; StaleFlow's router holds work back in the
    trajectory server instead of queueing it on an instance, so an instance below C_max with work
    it may still take is not winding down, it is being fed."""
    plan.repacks = plan_repack(idle, previous, config)
    routes: list[RouteDecision] = []
    for move in plan.repacks:
        source, dest = mutable(move.source), mutable(move.destination)
        plan.interrupts.setdefault(move.source, []).extend(move.trajectories)
        routes += [RouteDecision(move.destination, t, known.group_id, known.v_traj, False)
                   for t in move.trajectories if (known := on_instances.get(t)) is not None
                   and known.v_traj is not None]
        dest.running += source.running
        dest.waiting += source.waiting
        dest.kv_cache += source.kv_cache
        if dest.kv_usage is not None:
            dest.kv_usage += source.kv_usage or 0.0
        source.discard(set(move.trajectories))
        if source.version < ps_version:
            plan.syncs.append(move.source)
            source.version = ps_version
    return routes


def keeps_running(syncs: Sequence[str], instances: Sequence[InstanceState], config: StrategyConfig) -> list[str]:
    """The syncs whose Pull keeps the instance's trajectories and their KV cache.

    ``PullMode.AUTO``: a Pull keeps them unless they would decode markedly faster elsewhere. Each
    of the instance's running trajectories gets a token every step: ``speed / L(kv, n)`` tokens per
    second (Eq. 11 at its observed speed). Handed back, one would run on the peer where that rate,
    with it added, is highest. The Pull keeps them when their rate where they are is at least
    ``keep_share`` of that: on a busy fleet (every peer as loaded) nothing gains from moving and a
    kept Pull saves the re-prefill; a straggler, or an instance still full while its peers run
    out of work (the tail a tight bound makes the next buffer wait for), hands them back and
    routing spreads them over the fleet."""
    if config.pull is PullMode.INTERRUPT or not syncs:
        return []
    if config.pull is PullMode.KEEP or len(instances) < 2:
        return list(syncs)
    index = {inst.instance_id: k for k, inst in enumerate(instances)}
    costs = [inst.cost for inst in instances]
    k1 = np.array([c.k1 for c in costs])
    k5 = np.array([c.k5 for c in costs])
    kv = np.array([inst.kv_cache for inst in instances], dtype=float)
    n_after = np.array([len(inst.running) + 1 for inst in instances], dtype=float)
    # the parts of a peer's step latency with one more trajectory that do not depend on its length
    base = k1 * kv + np.maximum([c.k2 for c in costs], np.array([c.k3 for c in costs]) * n_after) + \
        np.array([c.k4 for c in costs])
    speed = np.array([inst.speed for inst in instances])
    room = np.array([c.kv_budget for c in costs]) - kv
    room[[bool(inst.waiting) for inst in instances]] = -1.0  # a trajectory would queue there
    kept: list[str] = []
    for instance_id in syncs:
        k = index[instance_id]
        inst = instances[k]
        if not inst.running:
            kept.append(instance_id)
            continue
        here = inst.speed / inst.cost.step_latency(inst.kv_cache, len(inst.running))
        context = inst.kv_cache / len(inst.running) / inst.cost.k5  # tokens of an average one
        elsewhere = np.where(room >= k5 * context, speed / (base + k1 * k5 * context), 0.0)
        elsewhere[k] = 0.0
        if here >= config.keep_share * float(elsewhere.max()):
            kept.append(instance_id)
    return kept


def _with_held_kept_pulls(syncs: list[str], instances: Sequence[InstanceState], ps_version: int,
                          config: StrategyConfig) -> tuple[list[str], list[str]]:
    """The cycle's Pulls (the sync strategy's, then ``held_kept_pulls``) and those that keep."""
    held = held_kept_pulls(instances, syncs, ps_version, config)
    return syncs + held, keeps_running(syncs, instances, config) + held


def held_kept_pulls(instances: Sequence[InstanceState], syncs: Sequence[str], ps_version: int,
                    config: StrategyConfig) -> list[str]:
    """One lagging instance load-aware sync held back whose Pull would keep its trajectories.

    Load-aware sync waits for a low load and for no waiting trajectory of the instance's version
    so that the Pull interrupts little; a Pull that keeps the trajectories and their KV cache
    interrupts nothing, so there is nothing to wait for. Held back, a busy lagging instance keeps
    taking new groups at its old version (routing scans the oldest version first), and each gets
    the earliest deadline the ledger still admits: a fleet that starts at one version stays there
    until all ``(eta + 1) x B`` of that version's admissions are spent, then the first buffer that
    needs a newer version waits for groups that all started at that moment (the larger eta, the
    later: throughput was not monotone in eta). Pulled, new groups start at the newest version,
    whose window reaches every buffer an older one does and one more.

    One a cycle, the stalest and then the least loaded (its Pull stalls the fewest trajectories):
    Pulls that share the parameter server's egress would all slow down together, so they are
    spread over time as load-aware sync spreads its own."""
    if config.sync is not SyncMode.LOAD_AWARE or config.pull is PullMode.INTERRUPT:
        return []
    synced = set(syncs)
    held = sorted((inst for inst in instances if inst.version < ps_version and inst.instance_id not in synced),
                  key=lambda inst: (inst.version, inst.kv_cache))
    for inst in held:
        if keeps_running([inst.instance_id], instances, config):
            return [inst.instance_id]
    return []


def _keep_in_place(plan: CyclePlan, migrated: dict[str, str], kept: set[str]) -> None:
    """A migrated trajectory that routing sends back where it was stays there: an Interrupt and a
    Route to the same instance would only recompute its KV cache (a sync's interrupts are kept,
    the Pull needs them, unless it keeps the trajectories: then they are all migrations)."""
    stay = {d.traj_id for d in plan.routes if migrated.get(d.traj_id) == d.instance_id}
    if not stay:
        return
    plan.routes = [d for d in plan.routes if d.traj_id not in stay]
    for instance_id in list(plan.interrupts):
        if instance_id in plan.syncs and instance_id not in kept:
            continue
        left = [t for t in plan.interrupts[instance_id] if t not in stay]
        if left:
            plan.interrupts[instance_id] = left
        else:
            del plan.interrupts[instance_id]
