"""Migration strategies: the authors' starved-instance migration and paper Appendix D
Algorithm 5 as printed.

Both move the excess of a long waiting queue (case 1: more than ``phi_wait`` waiting trajectories
make no progress where they are; the newest queued go). They differ in case 2:

* ``MigrationMode.STARVED`` (the authors' code): an instance is *starved* when its waiting queue is
  empty and no waiting trajectory may run on it at its version. Every other instance no newer than
  it whose throughput exceeds ``phi_throughput`` times the starved one's is a candidate; the one
  with the largest ratio hands all its trajectories back, unless it holds fewer than
  ``migration_min_trajectories`` (moving a handful buys little and pays their re-prefill). One
  instance per cycle.
* ``MigrationMode.THROUGHPUT`` (Algorithm 5): the busiest instance hands everything back when its
  throughput exceeds ``phi_throughput`` times the slowest peer's at least as new.
"""

from __future__ import annotations

from collections.abc import Sequence

from staleflow.config.strategy import MigrationMode, StrategyConfig
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory
from staleflow.strategies.sync import Routable


def plan_migrations(instances: Sequence[InstanceState], config: StrategyConfig,
                    pending: Sequence[PendingTrajectory] = (), budget: AdmissionBudget | None = None,
                    group_versions: dict[str, int] | None = None,
                    routable: Routable | None = None) -> dict[str, list[str]]:
    """Trajectories to interrupt, by instance, so that routing can place them better.

    ``pending``, ``budget`` and ``group_versions`` (what waits in the trajectory server and what
    the ledger admits) decide whether an instance is starved; without them every instance with an
    empty waiting queue counts as starved. ``routable``: ``pending`` as a ``Routable`` when the
    caller has built it already.
    """
    mode = config.migration.balance
    if mode is MigrationMode.NONE or not instances:
        return {}
    migrations: dict[str, list[str]] = {}
    for inst in instances:
        excess = len(inst.waiting) - config.phi_wait
        if excess > 0:
            migrations[inst.instance_id] = inst.waiting[-excess:]
    if mode is MigrationMode.STARVED:
        source = _feed_starved(instances, config, routable or Routable(pending, group_versions or {}),
                               budget or AdmissionBudget({}))
    else:
        source = _busiest_over_slowest(instances, config)
    if source is not None:
        already = migrations.get(source.instance_id, [])
        migrations[source.instance_id] = already + [t for t in source.trajectories if t not in set(already)]
    return migrations


def _busiest_over_slowest(instances: Sequence[InstanceState], config: StrategyConfig) -> InstanceState | None:
    # Only peers at least as new can take all of them (others would send them straight back),
    # and a single trajectory gains nothing from moving but pays re-prefill. An idle peer
    # (throughput 0) makes the ratio infinite.
    throughputs = {inst.instance_id: inst.throughput() for inst in instances}
    busiest = max(instances, key=lambda inst: throughputs[inst.instance_id])
    peers = [i for i in instances if i is not busiest and i.version >= busiest.version]
    top = throughputs[busiest.instance_id]
    if not peers or top <= 0 or len(busiest.trajectories) < 2:
        return None
    slowest = min(throughputs[p.instance_id] for p in peers)
    return busiest if slowest == 0 or top / slowest > config.phi_throughput else None


def _feed_starved(instances: Sequence[InstanceState], config: StrategyConfig, routable: Routable,
                  budget: AdmissionBudget) -> InstanceState | None:
    starving = [inst for inst in instances if not inst.waiting and not routable.on(inst, budget)]
    if not starving:
        return None
    throughputs = {inst.instance_id: inst.throughput() for inst in instances}
    best: tuple[float, float, InstanceState] | None = None
    for starved in starving:
        low = throughputs[starved.instance_id]
        for other in instances:
            if other is starved or other.version > starved.version or not other.trajectories:
                continue
            high = throughputs[other.instance_id]
            ratio = high / low if low > 0 else (float("inf") if high > 0 else 1.0)
            if ratio > config.phi_throughput and (best is None or (ratio, high) > best[:2]):
                best = (ratio, high, other)
    if best is None or len(best[2].trajectories) < config.migration_min_trajectories:
        return None
    return best[2]
