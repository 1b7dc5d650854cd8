"""Synchronization strategies: the authors' load-aware sync, paper Appendix D Algorithm 4 as
printed, and the baselines' greedy and global syncs.

Load-aware (``SyncMode.LOAD_AWARE``, what the authors' code does): a lagging instance Pulls when
its waiting queue is empty, its KV use is at most ``sync_kv_threshold`` of its budget and no
waiting trajectory that already has a V_traj may still run on it at its version (new groups do
not hold it back: they can start at the new version as well). A busy instance therefore keeps
generating at its version and syncs while its load is low, which interrupts fewer trajectories
than a sync the moment a version appears (greedy, global) and than Algorithm 4, whose first step
(no waiting trajectory may run at its version) is almost never true while new groups are admitted
at old versions."""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.config.strategy import StrategyConfig, SyncMode
from staleflow.strategies.routing import route
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory


class Routable:
    """What waits in the trajectory server, reduced to what Algorithm 2 asks of it: whether a new
    group waits (it may start on any instance whose version the ledger admits) and the oldest
    V_traj of a versioned one (it may run on any instance at least as new). Built once per cycle,
    asked per instance."""

    def __init__(self, pending: Sequence[PendingTrajectory], group_versions: dict[str, int]):
        self.group_versions = group_versions
        self.initial = False
        self.oldest: int | None = None
        versions = {t.v_traj if t.v_traj is not None else group_versions.get(t.group_id) for t in pending}
        self.initial = None in versions
        versions.discard(None)
        self.oldest = min(versions, default=None)  # type: ignore[arg-type]  # None discarded

    def include(self, t: PendingTrajectory) -> None:
        """One more waiting trajectory (handed back in this cycle)."""
        v = t.v_traj if t.v_traj is not None else self.group_versions.get(t.group_id)
        if v is None:
            self.initial = True
        elif self.oldest is None or v < self.oldest:
            self.oldest = v

    def on(self, inst: InstanceState, budget: AdmissionBudget) -> bool:
        if self.oldest is not None and self.oldest <= inst.version:
            return True
        return self.initial and budget.allows(inst.version)


def plan_syncs(
    instances: Sequence[InstanceState],
    pending: Sequence[PendingTrajectory],
    ps_version: int,
    budget: AdmissionBudget,
    config: StrategyConfig,
    group_versions: dict[str, int] | None = None,
    routable: Routable | None = None,
) -> list[str]:
    """Instances that should Pull ``ps_version`` now. ``routable``: ``pending`` as a ``Routable``
    when the caller has built it already."""
    if config.sync is SyncMode.NEVER:
        return []
    lagging = [inst for inst in instances if inst.version < ps_version]
    if config.sync in (SyncMode.GREEDY, SyncMode.GLOBAL):
        return [inst.instance_id for inst in lagging]
    group_versions = group_versions or {}
    if not lagging:
        return []
    routable = routable or Routable(pending, group_versions)
    if config.sync is SyncMode.LOAD_AWARE:
        return _load_aware(lagging, routable.oldest, config)
    syncs: list[str] = []
    for inst in lagging:
        # step 1: only an instance that cannot take any waiting trajectory at its version
        if routable.on(inst, budget):
            continue
        # step 2: a tentative update must let routing place work on it
        tentative = [other if other is not inst else _at_version(inst, ps_version) for other in instances]
        decisions = route(tentative, pending, budget, config, group_versions, stop_at_instance=inst.instance_id)
        if any(d.instance_id == inst.instance_id for d in decisions):
            syncs.append(inst.instance_id)
    return syncs


def _at_version(inst: InstanceState, version: int) -> InstanceState:
    updated = inst.copy()
    updated.version = version
    return updated


def _load_aware(lagging: list[InstanceState], oldest: int | None, config: StrategyConfig) -> list[str]:
    """``oldest``: the oldest V_traj waiting; a versioned trajectory may run on any instance this new."""
    syncs: list[str] = []
    for inst in lagging:
        if inst.waiting or inst.kv_cache > config.sync_kv_threshold * inst.cost.kv_budget:
            continue
        if oldest is not None and oldest <= inst.version:
            continue
        syncs.append(inst.instance_id)
    return syncs
