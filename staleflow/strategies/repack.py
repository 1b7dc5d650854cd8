"""Repack: Laminar's KV-driven consolidation of long tails (Laminar §5.2, Algorithm 1). Pure, no I/O.

An instance's KV utilisation ramps up to a plateau near its budget while waiting work refills it,
then falls once nothing is left to admit and its last, long trajectories finish (Laminar Fig. 9).
In that fall it is underused: few trajectories, each step paying the weights' read for a small
batch. Repack moves everything on such instances onto as few of them as fit, so the emptied ones
can Pull the newest version and take new work at once.

* **Candidates** (line 3): an instance in its ramp-down phase: KV utilisation below C_max and not
  above the previous reading (of the last repack check), and fewer than B trajectories.
* **Order** (line 4): smallest KV utilisation first: small sources are the easiest to place.
* **Destination** (lines 9-11): among the other candidates of the same version group (instances
  on the same weights) that are not emptied themselves, those where the source fits within C_max
  and B with everything already planned onto them; the most densely packed after the move wins.
* A destination never becomes a source later in the same plan (the printed algorithm allows it,
  which would move the trajectories it just received a second time).

C_max is ``repack_kv_share`` of the engine's KV budget; B is ``repack_batch`` or else the cost
model's roofline batch (``roofline_batch``). KV utilisation is what the engine reports
(``InstanceState.kv_usage``, the scheduler's block usage on vLLM) and otherwise the snapshot's KV
cache over the cost model's budget. Instances in a version group are taken as alike (the same KV
capacity), as Laminar's rollouts are.

A move is executed as an Interrupt on the source and a Route of each trajectory to the destination
(``plan_cycle``): the trajectory keeps its tokens and V_traj, and the destination, on the same
version, is one it may run on under the ledger's bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from staleflow.config.strategy import StrategyConfig
from staleflow.cost_model import CostModel
from staleflow.strategies.state import InstanceState


class RepackMove(NamedTuple):
    source: str
    destination: str
    trajectories: tuple[str, ...]  # everything on the source: running first, then waiting


def roofline_batch(cost: CostModel, growth: float) -> int:
    """B: the largest decode batch whose step, KV reads aside, takes at most ``1 + growth`` times a
    one-trajectory step. Below ``k2 / k3`` trajectories the GEMMs are memory-bound (the weights'
    read, ``k2``) and a larger batch costs nothing; past it each trajectory adds ``k3``. The KV
    reads (``k1``, ``k5``) grow with the batch's context whatever the batch size; C_max bounds
    them. At least 2: a destination holds its own trajectories and a source's."""
    if growth < 0:
        raise ValueError(f"growth must be >= 0, got {growth}")
    one = max(cost.k2, cost.k3) + cost.k4
    if cost.k3 == 0:
        raise ValueError("k3 is 0: every batch size decodes at the same step time, so B has no roofline; "
                         "set repack_batch")
    return max(2, int(((1 + growth) * one - cost.k4) / cost.k3 + 1e-9))


def kv_utilisation(inst: InstanceState) -> float:
    """The share of the instance's KV memory in use: as reported, else KV cache over budget."""
    if inst.kv_usage is not None:
        return inst.kv_usage
    return inst.kv_cache / inst.cost.kv_budget


def repack_limits(inst: InstanceState, config: StrategyConfig) -> tuple[float, int]:
    """(C_max as a utilisation share, B) for an instance."""
    batch = config.repack_batch if config.repack_batch is not None else \
        roofline_batch(inst.cost, config.repack_step_growth)
    return config.repack_kv_share, batch


def ramping_down(inst: InstanceState, previous: float | None, config: StrategyConfig) -> bool:
    """Algorithm 1, line 3: below C_max, not above the previous reading, fewer than B trajectories
    (and some: an empty instance has nothing to move)."""
    c_max, batch = repack_limits(inst, config)
    used = kv_utilisation(inst)
    n = len(inst.trajectories)
    return previous is not None and 0 < n < batch and used < c_max and used <= previous


def plan_repack(instances: Iterable[InstanceState], previous: Mapping[str, float],
                config: StrategyConfig) -> list[RepackMove]:
    """The moves of one repack check. ``previous``: each instance's KV utilisation at the last
    check (an instance without one is not a candidate). Inputs are not modified."""
    groups: dict[int, list[InstanceState]] = {}
    for inst in instances:
        if ramping_down(inst, previous.get(inst.instance_id), config):
            groups.setdefault(inst.version, []).append(inst)
    moves: list[RepackMove] = []
    for version in sorted(groups):
        moves += _best_fit(groups[version], config)
    return moves


def _best_fit(candidates: Sequence[InstanceState], config: StrategyConfig) -> list[RepackMove]:
    order = sorted(candidates, key=lambda inst: (kv_utilisation(inst), inst.instance_id))
    kv = {inst.instance_id: kv_utilisation(inst) for inst in order}
    count = {inst.instance_id: len(inst.trajectories) for inst in order}
    limits = {inst.instance_id: repack_limits(inst, config) for inst in order}
    emptied: set[str] = set()
    receiving: set[str] = set()
    moves: list[RepackMove] = []
    for source in order:
        s = source.instance_id
        if s in emptied or s in receiving:
            continue
        best: str | None = None
        for dest in order:
            d = dest.instance_id
            if d == s or d in emptied:
                continue
            c_max, batch = limits[d]
            if kv[d] + kv[s] > c_max or count[d] + count[s] > batch:
                continue
            if best is None or kv[d] > kv[best]:
                best = d
        if best is None:
            continue
        moves.append(RepackMove(s, best, tuple(source.trajectories)))
        kv[best] += kv[s]
        count[best] += count[s]
        emptied.add(s)
        receiving.add(best)
    return moves


class KvReadings:
    """The KV utilisation of each instance at the last repack check: the ``previous`` reading of
    the next one. Pure bookkeeping."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def previous(self) -> dict[str, float]:
        return dict(self._last)

    def record(self, instances: Iterable[InstanceState]) -> None:
        for inst in instances:
            self._last[inst.instance_id] = kv_utilisation(inst)

    def forget(self, instance_id: str) -> None:
        self._last.pop(instance_id, None)
