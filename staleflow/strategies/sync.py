"""Synchronization strategy (paper §5.3, Appendix D Algorithm 4) and its counterparts."""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.strategies.routing import route
from staleflow.strategies.state import (
    AdmissionBudget,
    InstanceState,
    PendingTrajectory,
    StrategyConfig,
    SyncMode,
)


def can_route_any(inst: InstanceState, pending: Sequence[PendingTrajectory], budget: AdmissionBudget,
                  group_versions: dict[str, int]) -> bool:
    """Whether some waiting trajectory may run on ``inst`` at its current version (Algorithm 2)."""
    for t in pending:
        v = t.v_traj if t.v_traj is not None else group_versions.get(t.group_id)
        if v is None:
            if budget.allows(inst.version):
                return True
        elif inst.version >= v:
            return True
    return False


def plan_syncs(
    instances: Sequence[InstanceState],
    pending: Sequence[PendingTrajectory],
    ps_version: int,
    budget: AdmissionBudget,
    config: StrategyConfig,
    group_versions: dict[str, int] | None = None,
) -> list[str]:
    """Instances that should Pull ``ps_version`` now."""
    lagging = [inst for inst in instances if inst.version < ps_version]
    if config.sync in (SyncMode.GREEDY, SyncMode.GLOBAL):
        return [inst.instance_id for inst in lagging]
    group_versions = group_versions or {}
    syncs = []
    for inst in lagging:
        # step 1: only an instance that cannot take any waiting trajectory at its version
        if can_route_any(inst, pending, budget, group_versions):
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
