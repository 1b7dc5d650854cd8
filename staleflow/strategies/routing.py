"""Routing strategy (paper §5.3, Appendix D Algorithms 2 and 3) and its vanilla counterpart.

Trajectories waiting in the trajectory server form a multi-level queue ordered by V_traj
(stalest first); initial trajectories, which have no version yet, come last. For the head of the
highest non-empty level, the candidate instances are those that may run it without breaking the
staleness bound (Algorithm 2): an initial trajectory may start at an instance's version only if
the ledger still admits a group of that version; a trajectory with a version may only resume on
an instance at least that new. Candidates are grouped by ascending version and scanned like a
waterfall: the first group whose best marginal gain (Eq. 3) reaches ``mu`` times the ideal gain
(Eq. 4) takes it. When no group does, the trajectory waits in the trajectory server; with
``scan_withheld`` (the authors' router) the pass goes on with the rest of its level (a shorter
trajectory may still fit) and ends with that level, otherwise it ends at once. With
``order_by_reserve`` the version groups of an initial trajectory are scanned by how many new
groups the ledger still admits at their version (fewest first), as the authors order candidates.

Groups: the first member of an initial group that is routed fixes the group's V_traj (and the
group is reserved in the ledger); its other members then have that version and follow the rules
of versioned trajectories.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from staleflow.config.strategy import RoutingMode, StrategyConfig
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory


@dataclass(frozen=True)
class RouteDecision:
    instance_id: str
    traj_id: str
    group_id: str
    v_traj: int
    reserves_group: bool  # first member of its group: reserve the group at v_traj before routing


class _MultiLevelQueue:
    def __init__(self, pending: Iterable[PendingTrajectory], group_versions: dict[str, int]):
        self.levels: dict[int, deque[PendingTrajectory]] = {}
        self.withheld = False  # a trajectory of the current level was passed over: the pass ends with it
        self.initial: dict[str, deque[PendingTrajectory]] = {}  # by group, groups in arrival order
        for t in sorted(pending, key=_SEQ):
            v = t.v_traj if t.v_traj is not None else group_versions.get(t.group_id)
            if v is None:
                self.initial.setdefault(t.group_id, deque()).append(t)
            else:
                self.levels.setdefault(v, deque()).append(t)

    def head(self) -> tuple[PendingTrajectory, int | None] | None:
        """The highest-priority trajectory and its version (None: initial)."""
        while self.levels:
            v = min(self.levels)
            if self.levels[v]:
                return self.levels[v][0], v
            del self.levels[v]
            if self.withheld:
                return None
        if self.withheld:
            return None
        for group in self.initial.values():
            return group[0], None
        return None

    def pop(self, traj: PendingTrajectory, v: int | None) -> None:
        if v is None:
            group = self.initial[traj.group_id]
            group.popleft()
            if not group:
                del self.initial[traj.group_id]
        else:
            self.levels[v].popleft()

    def withhold(self, v: int) -> None:
        """Pass over the head of level ``v``; the pass ends when this level is exhausted."""
        self.levels[v].popleft()
        self.withheld = True

    def promote_group(self, group_id: str, v: int) -> None:
        """The group now has version v: its remaining initial members join level v."""
        members = self.initial.pop(group_id, None)
        if members:
            self.levels.setdefault(v, deque()).extend(members)


class _VersionGroup:
    """The instances at one version as arrays, with Eq. 3 gains cached for one length.

    Routing evaluates the gain of every candidate for every trajectory; vectorising it and
    recomputing only the instance that just received work keeps a full pass over 2048
    trajectories and 128 instances in milliseconds.
    """

    def __init__(self, version: int, insts: list[InstanceState]):
        self.version = version
        self.insts = insts
        c = [inst.cost for inst in insts]
        self.k1 = np.array([m.k1 for m in c])
        self.k2 = np.array([m.k2 for m in c])
        self.k3 = np.array([m.k3 for m in c])
        self.k4 = np.array([m.k4 for m in c])
        self.k5 = np.array([m.k5 for m in c])
        self.budget = np.array([m.kv_budget for m in c])
        self.kv = np.array([inst.kv_cache for inst in insts], dtype=float)
        self.n = np.array([len(inst.running) for inst in insts], dtype=float)
        self.w = np.array([len(inst.waiting) for inst in insts], dtype=float)
        self.count = self.n + self.w
        self._length: int | None = None
        self._gains = np.zeros(len(insts))

    def _gain_vector(self, length: int) -> np.ndarray:
        kv, n = self.kv, self.n
        before = np.where(n > 0, n / (self.k1 * kv + np.maximum(self.k2, self.k3 * n) + self.k4), 0.0)
        grown = kv + self.k5 * length
        after = (n + 1) / (self.k1 * grown + np.maximum(self.k2, self.k3 * (n + 1)) + self.k4)
        fits = (self.w == 0) & (grown <= self.budget)
        return np.where(fits, after - before, 0.0)

    def best(self, length: int) -> tuple[int, float]:
        if length != self._length:
            self._gains = self._gain_vector(length)
            self._length = length
        i = int(np.argmax(self._gains))
        return i, float(self._gains[i])

    def ideal_gain(self, i: int, length: int) -> float:
        return self.insts[i].cost.ideal_gain(length)

    def add(self, i: int, traj_id: str, length: int) -> None:
        inst = self.insts[i]
        inst.add(traj_id, length)
        self.kv[i] = inst.kv_cache
        self.n[i] = len(inst.running)
        self.w[i] = len(inst.waiting)
        self.count[i] = self.n[i] + self.w[i]
        if self._length is not None:
            self._gains[i] = inst.marginal_gain(self._length)


def reachable(pending: Iterable[PendingTrajectory], budget: AdmissionBudget,
              group_versions: dict[str, int] | None = None) -> list[PendingTrajectory]:
    """The waiting trajectories a routing pass with ``budget`` can reach, in arrival order.

    Initial groups are taken in arrival order and each reservation uses admission, so a pass
    reserves at most ``budget.max_new_groups()`` of them: the initial members of later groups can
    neither be routed nor change a decision, and leaving them out (a trajectory server keeps
    thousands sampled ahead) makes every pass, and every tentative pass of selective sync, cheaper.
    Versioned trajectories and members of reserved groups are all kept.
    """
    group_versions = group_versions or {}
    limit = budget.max_new_groups()
    kept: list[PendingTrajectory] = []
    initial: set[str] = set()
    for t in sorted(pending, key=_SEQ):
        if t.v_traj is None and t.group_id not in group_versions and t.group_id not in initial:
            if len(initial) >= limit:
                continue
            initial.add(t.group_id)
        kept.append(t)
    return kept


_SEQ = attrgetter("seq")


def route(
    instances: Iterable[InstanceState],
    pending: Iterable[PendingTrajectory],
    budget: AdmissionBudget,
    config: StrategyConfig,
    group_versions: dict[str, int] | None = None,
    stop_at_instance: str | None = None,
) -> list[RouteDecision]:
    """Decide where waiting trajectories go. Works on copies: the inputs are not modified.

    ``group_versions`` gives the V_traj of groups already reserved whose members are still
    initial in the trajectory server. ``stop_at_instance`` ends the pass at the first decision
    for that instance (the synchronization strategy's tentative update only needs to know
    whether one happens).
    """
    by_version: dict[int, list[InstanceState]] = {}
    for inst in instances:
        by_version.setdefault(inst.version, []).append(inst.copy())
    groups = [_VersionGroup(v, insts) for v, insts in sorted(by_version.items())]
    budget = budget.copy()
    group_versions = dict(group_versions or {})
    queue = _MultiLevelQueue(pending, group_versions)
    in_flight = sum(int(g.count.sum()) for g in groups)
    choose = _waterfall if config.routing is RoutingMode.THROUGHPUT else _fewest_trajectories
    decisions: list[RouteDecision] = []

    while (head := queue.head()) is not None:
        traj, v = head
        if config.max_in_flight is not None and in_flight >= config.max_in_flight:
            break
        if v is None:  # Algorithm 2, initial: start at the instance's version if the ledger admits it
            candidates = [g for g in groups if budget.allows(g.version)]
            if config.order_by_reserve:  # the version with the fewest admissible groups left first
                admissible = budget.as_dict()
                candidates.sort(key=lambda g: (admissible.get(g.version, 0), g.version))
        else:  # Algorithm 2, versioned: only instances at least as new as V_traj
            candidates = [g for g in groups if g.version >= v]
        if not candidates:
            break
        if v is not None and config.versioned_by_gain and config.routing is RoutingMode.THROUGHPUT:
            chosen = _best_gain(candidates, traj.length, config.mu)
        else:
            chosen = choose(candidates, traj.length, config.mu)
        if chosen is None:  # withheld: no instance gains enough now; ongoing work may change that
            if v is None or not config.scan_withheld:
                break  # new groups all bring about a prompt: the next one would be withheld too
            queue.withhold(v)  # a shorter trajectory of the same level may still fit
            continue
        group, i = chosen
        queue.pop(traj, v)
        reserves = v is None
        if reserves:
            v = group.version
            budget.take(v)
            group_versions[traj.group_id] = v
            queue.promote_group(traj.group_id, v)
        group.add(i, traj.traj_id, traj.length)
        in_flight += 1
        instance_id = group.insts[i].instance_id
        decisions.append(RouteDecision(instance_id, traj.traj_id, traj.group_id, v, reserves))
        if instance_id == stop_at_instance:
            break
    return decisions


def _waterfall(candidates: list[_VersionGroup], length: int, mu: float) -> tuple[_VersionGroup, int] | None:
    """Algorithm 3, steps 2-4: the oldest-version group whose best gain clears the threshold."""
    for group in candidates:
        i, gain = group.best(length)
        if gain >= mu * group.ideal_gain(i, length):
            return group, i
    return None


def _best_gain(candidates: list[_VersionGroup], length: int, mu: float) -> tuple[_VersionGroup, int] | None:
    """A trajectory that already has its version: the largest gain (Eq. 3) over every admissible
    instance, if it clears the threshold; its staleness is the same wherever it runs."""
    best: tuple[_VersionGroup, int] | None = None
    top = -1.0
    for group in candidates:
        i, gain = group.best(length)
        if gain >= mu * group.ideal_gain(i, length) and gain > top:
            best, top = (group, i), gain
    return best


def _fewest_trajectories(candidates: list[_VersionGroup], length: int, mu: float) -> tuple[_VersionGroup, int] | None:
    """Vanilla routing (§6.5): balance trajectory counts, no threshold."""
    best: tuple[_VersionGroup, int] | None = None
    fewest = float("inf")
    for group in candidates:
        i = int(np.argmin(group.count))
        if group.count[i] < fewest:
            best, fewest = (group, i), group.count[i]
    return best
