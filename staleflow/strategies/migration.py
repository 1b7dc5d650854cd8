"""Migration strategy (paper §5.3, Appendix D Algorithm 5)."""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.strategies.state import InstanceState, MigrationMode, StrategyConfig


def plan_migrations(instances: Sequence[InstanceState], config: StrategyConfig) -> dict[str, list[str]]:
    """Trajectories to interrupt, by instance, so that routing can place them better."""
    if config.migration is MigrationMode.NONE or not instances:
        return {}
    migrations: dict[str, list[str]] = {}
    # case 1: waiting trajectories beyond phi_wait make no progress here; the newest queued go
    for inst in instances:
        excess = len(inst.waiting) - config.phi_wait
        if excess > 0:
            migrations[inst.instance_id] = inst.waiting[-excess:]
    # case 2: throughput imbalance; the busiest instance hands all its trajectories back.
    # Only peers at least as new can take all of them (others would send them straight back),
    # and a single trajectory gains nothing from moving but pays re-prefill. An idle peer
    # (throughput 0) makes the ratio infinite.
    throughputs = {inst.instance_id: inst.throughput() for inst in instances}
    busiest = max(instances, key=lambda inst: throughputs[inst.instance_id])
    peers = [i for i in instances if i is not busiest and i.version >= busiest.version]
    top = throughputs[busiest.instance_id]
    if not peers or top <= 0 or len(busiest.trajectories) < 2:
        return migrations
    slowest = min(throughputs[p.instance_id] for p in peers)
    if slowest == 0 or top / slowest > config.phi_throughput:
        already = migrations.get(busiest.instance_id, [])
        migrations[busiest.instance_id] = already + [t for t in busiest.trajectories if t not in set(already)]
    return migrations
