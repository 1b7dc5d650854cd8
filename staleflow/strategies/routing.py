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

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import NamedTuple, cast

import numpy as np

from staleflow.config.strategy import RoutingMode, StrategyConfig
from staleflow.strategies.state import AdmissionBudget, InstanceState, PendingTrajectory
from staleflow.strategies.withheld_bounds import WithheldBounds


class RouteDecision(NamedTuple):  # a tuple: a pass creates thousands, a frozen dataclass costs 10x more
    instance_id: str
    traj_id: str
    group_id: str
    v_traj: int
    reserves_group: bool  # first member of its group: reserve the group at v_traj before routing


# RouteDecision(...) runs a Python-level __new__; tuple.__new__ builds the same tuple in a third of the time
_new_tuple = cast("Callable[[type[RouteDecision], tuple[str, str, str, int, bool]], RouteDecision]",
                  tuple.__new__)  # pyright: ignore[reportUnknownMemberType]


class _MultiLevelQueue:
    def __init__(self, pending: Iterable[PendingTrajectory], group_versions: dict[str, int],
                 longest_first: bool = False, in_order: bool = False):
        """``in_order``: ``pending`` is a sequence in arrival order already (``reachable``'s)."""
        self.withheld = False  # a trajectory of the current level was passed over: the pass ends with it
        # by group, groups in arrival order (longest_first: by their first member's predicted remainder)
        self.initial: dict[str, deque[PendingTrajectory]] = {}
        ordered = cast("Sequence[PendingTrajectory]", pending) if in_order else sorted(pending, key=_SEQ)
        initial = [t for t in ordered if t.v_traj is None and t.group_id not in group_versions]
        levels: dict[int, list[PendingTrajectory]] = {}
        if len(initial) < len(ordered):
            version_of = group_versions.get
            for t in ordered:
                v = t.v_traj
                if v is None:
                    v = version_of(t.group_id)
                    if v is None:
                        continue
                level = levels.get(v)
                if level is None:
                    levels[v] = [t]
                else:
                    level.append(t)
        self.levels = {v: deque(level) for v, level in levels.items()}
        # a group's members usually arrive together: one dict operation per run of them
        for group_id, members in itertools.groupby(initial, key=_GROUP):
            group = self.initial.get(group_id)
            if group is None:
                self.initial[group_id] = deque(members)
            else:
                group.extend(members)
        if longest_first:  # stable: arrival order among equal predictions
            for v, level in self.levels.items():
                self.levels[v] = deque(sorted(level, key=_REMAINING, reverse=True))
            order = sorted(self.initial.values(), key=lambda group: group[0].remaining, reverse=True)
            self.initial = {group[0].group_id: group for group in order}

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


SPEED_TOLERANCE = 0.1  # routing by speed treats an instance within 10 % of the cost model as modelled


class _Fleet:
    """Every instance of a pass as arrays, ordered by version, with the Eq. 3 gains of one length.

    Routing evaluates the gain of every candidate for every trajectory; vectorising it over the
    whole fleet at once (one evaluation serves every version group), keeping the parts that do
    not depend on the length per instance, and recomputing only the instance that just received
    work keeps a full pass over 2048 trajectories and 128 instances in milliseconds. The pass
    works on these arrays alone: the instances' snapshots are read once and never copied. When
    every instance has the same cost model (the usual fleet) its coefficients are scalars, which
    gives the same numbers with fewer array operations.
    """

    def __init__(self, insts: list[InstanceState], by_speed: bool = False, counts: bool = True, mu: float = 0.0):
        self.ids = [inst.instance_id for inst in insts]
        self.costs = [inst.cost for inst in insts]
        # gains scaled by each instance's observed decode speed: a straggler's tokens come slower
        # (within SPEED_TOLERANCE of the model, measurement error: as modelled)
        speeds = [inst.speed if abs(inst.speed - 1.0) > SPEED_TOLERANCE else 1.0 for inst in insts] if by_speed else []
        # every speed 1.0 scales nothing (x * 1.0 is x): no multiply per evaluation
        self.speed = np.array(speeds) if any(s != 1.0 for s in speeds) else None
        self.speed_zero = 0.0 in speeds
        c = self.costs
        uniform = len(set({id(m): m for m in c}.values())) <= 1  # equal models count as one; hash each object once
        names = ("k1", "k2", "k3", "k4", "k5", "kv_budget")
        k1, k2, k3, k4, k5, budget = (np.full(len(c), getattr(c[0], name), dtype=float) for name in names) \
            if uniform and c else (np.array([getattr(m, name) for m in c], dtype=float) for name in names)
        self.uniform = uniform and bool(c)
        # a uniform fleet's coefficients as floats (``add_uniform``, ``ideal_gain``), and its KV budget
        self.coefficients = (c[0].k1, c[0].k2, c[0].k3, c[0].k4, c[0].k5) if self.uniform else (0.0,) * 5
        self.kv_budget = c[0].kv_budget if self.uniform else 0.0
        if self.uniform:
            self.k1, self.k4, self.k5 = c[0].k1, c[0].k4, c[0].k5
        else:
            self.k1, self.k4, self.k5 = k1, k4, k5
        self.kv_list = [float(inst.kv_cache) for inst in insts]
        self.n_list = [len(inst.running) for inst in insts]
        self.w_list = [len(inst.waiting) for inst in insts]
        self.kv = np.array(self.kv_list, dtype=float)
        n = np.array(self.n_list, dtype=float)
        self.count = n + np.array(self.w_list, dtype=float)
        self.counts = counts  # keep ``count`` current (vanilla routing balances it; the gains never read it)
        # the parts of Eq. 3 that do not depend on the routed length
        before = np.where(n > 0, n / (k1 * self.kv + np.maximum(k2, k3 * n) + k4), 0.0)
        self.after_n = n + 1
        self.after_base = np.maximum(k2, k3 * self.after_n)
        # the KV budget where a trajectory would run at once (nothing waits there), else -inf
        self.budget = budget
        waiting = np.array(self.w_list) > 0
        self.room = np.where(waiting, -np.inf, budget)
        # the throughput before, +inf where something waits: the gain there is -inf before the
        # mask sets it to 0, and ``gains_free`` needs no mask for it
        self.before = np.where(waiting, np.inf, before)
        self.kv_free_max = float(self.kv[~waiting].max()) if not waiting.all() else -np.inf
        # ``at_length``'s gains may be -inf where something waits instead of 0: both are below a
        # positive threshold (mu > 0, one cost model: every threshold is mu x the same ideal gain),
        # so every decision is the same; a speed of 0 would make -inf x 0 NaN
        self.free = self.uniform and mu > 0 and all(s > 0 for s in speeds)
        # the ideal gain's (Eq. 4) denominator without the KV term, per instance
        self.ideal_base = np.maximum(k2, k3 * 1)
        self.k1_all, self.k4_all, self.k5_all = k1, k4, k5
        self.length: int | None = None  # the length ``gains`` holds the gains of
        self.gains = np.zeros(len(insts))
        self._grown, self._denominator = np.empty(len(insts)), np.empty(len(insts))
        self._unfit = np.empty(len(insts), dtype=bool)
        self.changed: list[int] | None = None  # where ``add_uniform`` started a trajectory, for ``WithheldBounds``
        # ``best_free``'s denominators without the length term (built at its first call), and the
        # bound on the error of its gains: every gain and throughput before is below 1 / k3
        self.fixed: np.ndarray | None = None
        k3_scalar = self.coefficients[2]
        self.approximate = self.free and self.speed is None and k3_scalar > 0
        self.approximation_error = 512 * 2.0 ** -53 / k3_scalar if self.approximate else 0.0

    def gains_for(self, lengths: np.ndarray | int) -> np.ndarray:
        """Eq. 3 for every instance (one row per length when ``lengths`` is a column). One length
        works in buffers kept for it; a boolean mask written with ``putmask`` costs a third of
        indexing with it."""
        if isinstance(lengths, np.ndarray):
            grown = self.kv + self.k5 * lengths
            denominator = self.k1 * grown
            unfit = grown > self.room
        else:
            grown = np.add(self.kv, self.k5 * lengths, out=self._grown)
            denominator = np.multiply(self.k1, grown, out=self._denominator)
            unfit = np.greater(grown, self.room, out=self._unfit)
        denominator += self.after_base
        denominator += self.k4
        gains = np.divide(self.after_n, denominator)
        gains -= self.before
        if self.speed is not None:
            self._scale(gains, self.speed)
        np.putmask(gains, unfit, 0.0)  # grown > room: nothing is NaN, so exactly ~(grown <= room)
        return gains

    def gains_at(self, index: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``gains_for`` of the instances at ``index`` only (a uniform fleet: scalar coefficients)."""
        grown = self.kv[index] + self.k5 * lengths
        denominator = self.k1 * grown
        denominator += self.after_base[index]
        denominator += self.k4
        gains = np.divide(self.after_n[index], denominator, out=denominator)
        gains -= self.before[index]
        if self.speed is not None:
            self._scale(gains, self.speed[index])
        np.putmask(gains, grown > self.room[index], 0.0)
        return gains

    def _scale(self, gains: np.ndarray, speed: np.ndarray) -> None:
        """``gains *= speed``; a speed of 0 turns a waiting instance's -inf into NaN, which the
        mask then sets to 0 like every gain there (without a warning)."""
        if self.speed_zero:
            with np.errstate(invalid="ignore"):
                gains *= speed
        else:
            gains *= speed

    def gains_free(self, length: int) -> np.ndarray | None:
        """``gains_for`` one length on a fleet of ``free`` gains: where nothing waits and every
        instance has room for ``length`` (None if one might not), the same numbers with three
        array operations fewer, and -inf where something waits instead of 0."""
        k5_length = self.k5 * length
        if not self.kv_free_max + k5_length <= self.kv_budget:
            return None
        grown = np.add(self.kv, k5_length, out=self._grown)
        denominator = np.multiply(self.k1, grown, out=self._denominator)
        denominator += self.after_base
        denominator += self.k4
        gains = np.divide(self.after_n, denominator)
        gains -= self.before
        if self.speed is not None:
            gains *= self.speed
        return gains

    def ideal(self, lengths: np.ndarray) -> np.ndarray:
        """Eq. 4 of a uniform fleet for many lengths, the arithmetic of ``CostModel.ideal_gain``."""
        return 1.0 / (self.k1 * (self.k5 * lengths) + self.ideal_base[0] + self.k4)

    def ideal_gain(self, length: int) -> float:
        """Eq. 4 of a uniform fleet for one length: ``CostModel.ideal_gain``'s arithmetic, 1 / L(k5 l, 1)."""
        k1, k2, k3, k4, k5 = self.coefficients
        compute = k3 * 1
        return 1.0 / (k1 * (k5 * length) + (compute if compute > k2 else k2) + k4)

    def at_length(self, length: int) -> np.ndarray:
        if length != self.length:
            gains = self.gains_free(length) if self.free else None
            self.gains = self.gains_for(length) if gains is None else gains
            self.length = length
        return self.gains

    def best_free(self, length: int, lo: int, hi: int, threshold: float) -> tuple[int, float] | None:
        """The first instance of ``[lo, hi)`` with the largest gain for ``length`` and that gain,
        from three array operations instead of six: ``(n + 1) / (fixed + k1 k5 l) - before``
        rounds differently from ``gains_for``'s arithmetic, by less than ``approximation_error``
        (every term is positive, a few roundings of relative 2^-53 each, on values below 1 / k3).
        So where the largest is clear of the runner-up by twice that, it is the largest of the
        exact gains too, and its exact gain is computed alone; a largest below ``threshold`` by
        that margin is withheld, with that upper bound as its gain. None: too close to tell (or
        this fleet has no such bound), for ``gains_for`` to decide."""
        if not self.approximate or not self.kv_free_max + self.k5 * length <= self.kv_budget:
            return None
        gains = self.approximate_gains(length)
        view = gains if lo == 0 and hi == len(gains) else gains[lo:hi]
        i = int(view.argmax())
        largest, error = view.item(i), self.approximation_error
        if largest + error < threshold:
            return lo + i, largest + error
        view[i] = -np.inf
        if not view.max() + error < largest - error:
            return None
        return lo + i, self.gain_of(lo + i, length)

    def approximate_gains(self, length: int) -> np.ndarray:
        """``best_free``'s gains (in a buffer the next evaluation reuses)."""
        if self.fixed is None:  # kept current by ``add_uniform`` from now on
            self.fixed = self.k1 * self.kv + self.after_base + self.k4
            if self.changed is None:
                self.changed = []
        gains = np.add(self.fixed, self.k1 * self.k5 * length, out=self._grown)
        np.divide(self.after_n, gains, out=gains)
        gains -= self.before
        return gains

    def gain_of(self, i: int, length: int) -> float:
        """``gains_for(length)[i]`` of a uniform fleet without speeds, in Python floats (the same
        arithmetic, step for step)."""
        grown = self.kv_list[i] + self.k5 * length
        if grown > self.room.item(i):
            return 0.0
        return (self.n_list[i] + 1) / (self.k1 * grown + self.after_base.item(i) + self.k4) - self.before.item(i)

    def add(self, i: int, length: int) -> None:
        """``InstanceState.add`` on the arrays: it runs if it fits and nothing waits, else it waits."""
        if self.uniform:
            self.add_uniform(i, length)
            return
        cost = self.costs[i]
        kv, n, w = self.kv_list[i], self.n_list[i], self.w_list[i]
        if self.counts:
            self.count[i] = n + w + 1
        if w == 0 and kv + cost.k5 * length <= cost.kv_budget:
            kv += cost.k5 * length
            n += 1
            self.kv_list[i] = kv
            self.n_list[i] = n
            self.kv[i] = kv
        else:
            self.w_list[i] = w = w + 1
            self.room[i] = -np.inf
        # the same arithmetic as CostModel.marginal_gain, sharing the throughput before
        before = n / (cost.k1 * kv + max(cost.k2, cost.k3 * n) + cost.k4) if n > 0 else 0.0
        after_base = max(cost.k2, cost.k3 * (n + 1))
        self.before[i] = before if w == 0 else np.inf
        self.after_n[i] = n + 1
        self.after_base[i] = after_base
        if self.length is not None:
            grown = kv + cost.k5 * self.length
            fits = w == 0 and grown <= cost.kv_budget
            gain = (n + 1) / (cost.k1 * grown + after_base + cost.k4) - before if fits else 0.0
            self.gains[i] = gain if self.speed is None else gain * self.speed[i]


    def add_uniform(self, i: int, length: int) -> None:
        """``add`` with the fleet's one cost model in locals: the arithmetic of ``add`` step for
        step (a route is the initial fill's unit of work: 16,384 of them at 1,024 instances). A
        trajectory that waits changes neither the instance's KV nor its running count, so only
        its queue, room and gain change."""
        k1, k2, k3, k4, k5 = self.coefficients
        kv, n, w = self.kv_list[i], self.n_list[i], self.w_list[i]
        if self.counts:
            self.count[i] = n + w + 1
        grow = k5 * length
        if not (w == 0 and kv + grow <= self.kv_budget):
            self.w_list[i] = w + 1
            self.room[i] = -np.inf
            self.before[i] = np.inf
            if self.length is not None:
                self.gains[i] = 0.0
            return
        kv += grow
        n += 1
        self.kv_list[i] = kv
        self.n_list[i] = n
        self.kv[i] = kv
        if kv > self.kv_free_max:
            self.kv_free_max = kv
        compute = k3 * n
        before = n / (k1 * kv + (compute if compute > k2 else k2) + k4)
        compute = k3 * (n + 1)
        after_base = compute if compute > k2 else k2
        self.before[i] = before
        self.after_n[i] = n + 1
        self.after_base[i] = after_base
        changed = self.changed  # None until a steady scan needs it (a fill checks only this)
        if changed is not None:  # a trajectory that waits only lowers the instance's gains: not reported
            changed.append(i)
            if self.fixed is not None:
                self.fixed[i] = k1 * kv + after_base + k4
        at = self.length
        if at is not None:
            grown = kv + (grow if at == length else k5 * at)
            gain = (n + 1) / (k1 * grown + after_base + k4) - before if grown <= self.kv_budget else 0.0
            self.gains[i] = gain if self.speed is None else gain * self.speed[i]


class _VersionGroup:
    """The instances at one version: a slice of the fleet."""

    def __init__(self, version: int, fleet: _Fleet, lo: int, hi: int):
        self.version = version
        self.fleet = fleet
        self.lo, self.hi = lo, hi
        self.ids = fleet.ids[lo:hi]
        self.costs = fleet.costs[lo:hi]
        self.count = fleet.count[lo:hi]  # a view: follows the fleet's updates
        self._whole = lo == 0 and hi == len(fleet.ids)
        self._ideal: dict[tuple[int, int], float] = {}

    def best(self, length: int) -> tuple[int, float]:
        gains = self.fleet.at_length(length)
        if not self._whole:
            gains = gains[self.lo:self.hi]
        i = int(gains.argmax())
        return i, float(gains[i])

    def ideal_gain(self, i: int, length: int) -> float:
        if self.fleet.uniform:
            return self.fleet.ideal_gain(length)
        cost = self.costs[i]
        key = (id(cost), length)
        ideal = self._ideal.get(key)
        if ideal is None:
            ideal = self._ideal[key] = cost.ideal_gain(length)
        return ideal

    def withheld_rows(self, gains: np.ndarray, lengths: np.ndarray, mu: float) -> np.ndarray:
        """For each row of the fleet's ``gains`` (one length each), whether this group's best
        instance misses the threshold: ``best`` and ``ideal_gain`` for many lengths at once,
        element for element the same arithmetic."""
        f = self.fleet
        best = gains[:, self.lo:self.hi].argmax(axis=1) + self.lo
        ideal = 1.0 / (f.k1_all[best] * (f.k5_all[best] * lengths) + f.ideal_base[best] + f.k4_all[best])
        return ~(gains[np.arange(len(lengths)), best] >= mu * ideal)


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
    keep = kept.append
    for t in sorted(pending, key=_SEQ):
        if t.v_traj is None:
            group_id = t.group_id
            if group_id not in group_versions and group_id not in initial:
                if len(initial) >= limit:
                    continue
                initial.add(group_id)
        keep(t)
    return kept


_SEQ = attrgetter("seq")
_GROUP = attrgetter("group_id")
_REMAINING = attrgetter("remaining")


def route(
    instances: Iterable[InstanceState],
    pending: Iterable[PendingTrajectory],
    budget: AdmissionBudget,
    config: StrategyConfig,
    group_versions: dict[str, int] | None = None,
    stop_at_instance: str | None = None,
    lookahead: bool = True,
    in_order: bool = False,
) -> list[RouteDecision]:
    """Decide where waiting trajectories go. Works on copies: the inputs are not modified.

    ``group_versions`` gives the V_traj of groups already reserved whose members are still
    initial in the trajectory server. ``stop_at_instance`` ends the pass at the first decision
    for that instance (the synchronization strategy's tentative update only needs to know
    whether one happens). ``lookahead``: when scanning past withheld versioned trajectories,
    test a run of them at once against the unchanged instances (same decisions; False: one at a
    time, the reference the tests compare it with). ``in_order``: ``pending`` is a sequence in
    arrival order already (``reachable``'s), not sorted again.
    """
    fleet, groups = _fleet_of(instances, config)
    budget = budget.copy()
    group_versions = dict(group_versions or {})
    queue = _MultiLevelQueue(pending, group_versions, config.length_aware, in_order)
    in_flight = int(fleet.count.sum())
    choose = _waterfall if config.routing is RoutingMode.THROUGHPUT else _fewest_trajectories
    decisions: list[RouteDecision] = []
    by_gain = config.versioned_by_gain and config.routing is RoutingMode.THROUGHPUT
    scan = _WithheldScan(lookahead and by_gain and config.scan_withheld)
    newer: dict[int, list[_VersionGroup]] = {}  # the candidates of a versioned trajectory, by its version
    bounds = WithheldBounds(fleet) if by_gain and fleet.uniform and fleet.speed is None and config.mu > 0 else None

    while (head := queue.head()) is not None:
        traj, v = head
        if config.max_in_flight is not None and in_flight >= config.max_in_flight:
            break
        candidates = _candidates(v, groups, budget, config.order_by_reserve, newer)
        if not candidates:
            break
        if v is not None and v == scan.level and scan.skip(queue, v, candidates, config.mu):
            continue
        if v is not None and by_gain and fleet.uniform and config.mu > 0:
            in_flight, decided, ended = _route_uniform(queue, v, candidates, config, in_flight, stop_at_instance,
                                                       decisions, bounds)
            if ended:
                break
            if decided:
                scan.routed()
                continue
            chosen = None
        elif v is not None and by_gain:
            chosen = _best_gain(candidates, traj.length, config.mu)
        else:
            chosen = choose(candidates, traj.length, config.mu)
        if chosen is None:  # withheld: no instance gains enough now; ongoing work may change that
            if v is None or not config.scan_withheld:
                break  # new groups all bring about a prompt: the next one would be withheld too
            queue.withhold(v)  # a shorter trajectory of the same level may still fit
            scan.withheld(v)
            continue
        group, i = chosen
        queue.pop(traj, v)
        reserves = v is None
        if v is None:
            v = group.version
            budget.take(v)
            group_versions[traj.group_id] = v
            queue.promote_group(traj.group_id, v)
        fleet.add(group.lo + i, traj.length)
        scan.routed()
        in_flight += 1
        instance_id = group.ids[i]
        decisions.append(_new_tuple(RouteDecision, (instance_id, traj.traj_id, traj.group_id, v, reserves)))
        if instance_id == stop_at_instance:
            break
    return decisions


_LOOKAHEAD_MIN, _LOOKAHEAD_MAX = 8, 256  # trajectories tested at once; doubled while all are withheld
_SCAN_AFTER = 8  # withheld in a row before the rest of the level is tested in runs


def _candidates(v: int | None, groups: list[_VersionGroup], budget: AdmissionBudget, order_by_reserve: bool,
                newer: dict[int, list[_VersionGroup]]) -> list[_VersionGroup]:
    """Algorithm 2: the version groups a trajectory of version ``v`` (None: initial) may go to.
    ``newer`` keeps a versioned trajectory's, which do not change during a pass."""
    if v is None:  # initial: start at the instance's version if the ledger admits it
        candidates = [g for g in groups if budget.allows(g.version)]
        if order_by_reserve:  # the version with the fewest admissible groups left first
            admissible = budget.as_dict()
            candidates.sort(key=lambda g: (admissible.get(g.version, 0), g.version))
        return candidates
    candidates = newer.get(v)  # versioned: only instances at least as new as V_traj
    if candidates is None:
        candidates = newer[v] = [g for g in groups if g.version >= v]
    return candidates


def _fleet_of(instances: Iterable[InstanceState], config: StrategyConfig) -> tuple[_Fleet, list[_VersionGroup]]:
    """The pass's fleet, ordered by version, and its version groups (slices of it, oldest first)."""
    by_version: dict[int, list[InstanceState]] = {}
    for inst in instances:
        by_version.setdefault(inst.version, []).append(inst)  # read, never changed: the fleet's arrays change
    fleet = _Fleet([inst for _, insts in sorted(by_version.items()) for inst in insts], config.route_by_speed,
                   counts=config.routing is RoutingMode.VANILLA, mu=config.mu)
    groups: list[_VersionGroup] = []
    lo = 0
    for v, insts in sorted(by_version.items()):
        groups.append(_VersionGroup(v, fleet, lo, lo + len(insts)))
        lo += len(insts)
    return fleet, groups


class _WithheldScan:
    """Withheld trajectories of a level: while nothing is routed nothing changes, so after
    ``_SCAN_AFTER`` of them in a row the rest of the level is tested in runs, one evaluation for
    a run (most runs are one or two long, and testing a run costs more than testing those one at
    a time). ``enabled`` False: always one at a time, the reference the tests compare it with."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.level: int | None = None  # the level being tested in runs
        self.window = _LOOKAHEAD_MIN
        self.in_a_row, self.last = 0, None  # withheld in a row, of level ``last``

    def withheld(self, v: int) -> None:
        self.in_a_row = self.in_a_row + 1 if v == self.last else 1
        self.last = v
        if self.enabled and self.in_a_row >= _SCAN_AFTER:
            self.level = v

    def routed(self) -> None:
        self.last = None

    def skip(self, queue: _MultiLevelQueue, v: int, candidates: list[_VersionGroup], mu: float) -> bool:
        """Withhold the run at the front of level ``v`` that no instance gains enough from; True
        when the pass should look at the level's new head (False: the head routes now)."""
        skipped = _withheld_run(queue.levels[v], candidates, mu, self.window)
        for _ in range(skipped):
            queue.withhold(v)
        if skipped == self.window:
            self.window = min(2 * self.window, _LOOKAHEAD_MAX)
            return True
        self.level, self.window = None, _LOOKAHEAD_MIN  # the head is not withheld: it routes below
        return skipped > 0


def _withheld_run(level: deque[PendingTrajectory], candidates: list[_VersionGroup], mu: float, window: int) -> int:
    """How many trajectories at the front of ``level`` (at most ``window``) ``_best_gain`` would
    withhold one after the other: none of them changes an instance, so one evaluation decides all."""
    lengths = np.fromiter((t.length for t in itertools.islice(level, window)), dtype=float)
    fleet = candidates[0].fleet
    if fleet.uniform and mu > 0:
        return _withheld_run_uniform(fleet, candidates, lengths, mu)
    gains = fleet.gains_for(lengths[:, None])
    withheld = np.ones(len(lengths), dtype=bool)
    for group in candidates:
        withheld &= group.withheld_rows(gains, lengths, mu)
    routable = np.flatnonzero(~withheld)
    return int(routable[0]) if len(routable) else len(lengths)


def _withheld_run_uniform(fleet: _Fleet, candidates: list[_VersionGroup], lengths: np.ndarray, mu: float) -> int:
    """``_withheld_run`` on a fleet of one cost model. The threshold is then the same for every
    instance, so a trajectory is withheld exactly when no candidate clears it, and a gain only
    falls as the length grows: an instance whose gain at the shortest length misses the threshold
    of the longest clears no row, and only the others are evaluated for every length."""
    lo, hi = candidates[0].lo, candidates[-1].hi  # the versions >= V_traj: a suffix of the fleet
    threshold = mu * fleet.ideal(lengths)
    first = fleet.gains_for(lengths.min())[lo:hi]
    index = np.flatnonzero(first >= threshold.min()) + lo
    if not len(index):
        return len(lengths)
    clears = (fleet.gains_at(index, lengths[:, None]) >= threshold[:, None]).any(axis=1)
    routable = np.flatnonzero(clears)
    return int(routable[0]) if len(routable) else len(lengths)


def _route_run(level: deque[PendingTrajectory], v: int, candidates: list[_VersionGroup], mu: float, limit: int | None,
               stop_at_instance: str | None, decisions: list[RouteDecision], bounds: WithheldBounds | None = None
               ) -> tuple[int, bool]:
    """``_best_gain`` on a fleet of one cost model for the trajectories at the front of ``level``
    that share the head's length (a group's members bring the same prompt), routed one after the
    other without leaving this loop: the gains of that length are evaluated once and each route
    updates only its instance's. Stops before the first one no instance gains enough from (left to
    the caller to withhold), after ``limit`` routes, or after a route to ``stop_at_instance``.
    Returns the number routed and whether it stopped at ``stop_at_instance``."""
    fleet = candidates[0].fleet
    lo, hi = candidates[0].lo, candidates[-1].hi
    length = level[0].length
    threshold = mu * fleet.ideal_gain(length)
    if bounds is not None and length != fleet.length and bounds.withholds(lo, length, threshold):
        return 0, False
    gains = fleet.gains if length == fleet.length else fleet.at_length(length)
    view = gains if lo == 0 and hi == len(gains) else gains[lo:hi]  # ``add`` updates ``gains`` in place
    ids, append, popleft = fleet.ids, decisions.append, level.popleft
    add = fleet.add_uniform
    argmax, item = view.argmax, view.item
    run = 0
    for traj in level:
        if traj.length != length or run == limit:
            break
        run += 1
    for routed in range(run):
        i = int(argmax())
        if not item(i) >= threshold:
            if bounds is not None and routed == 0:
                bounds.record(lo, length, item(i))
            return routed, False
        traj = popleft()
        i += lo
        add(i, length)
        append(_new_tuple(RouteDecision, (ids[i], traj.traj_id, traj.group_id, v, False)))
        if ids[i] == stop_at_instance:
            return routed + 1, True
    return run, False


def _route_uniform(queue: _MultiLevelQueue, v: int, candidates: list[_VersionGroup], config: StrategyConfig,
                   in_flight: int, stop_at_instance: str | None, decisions: list[RouteDecision],
                   bounds: WithheldBounds | None) -> tuple[int, bool, bool]:
    """A versioned trajectory at the head of level ``v`` on a fleet of one cost model with
    ``mu > 0``: those of a length of their own from there on (``_route_singles``), else the run of
    a group's members (``_route_run``). Returns the trajectories in flight, whether any was
    decided (False: the head is withheld) and whether the pass ends."""
    fleet = candidates[0].fleet
    if bounds is not None and fleet.approximate and _single(queue.levels[v]):
        in_flight, handled, ended = _route_singles(queue, v, candidates, config, in_flight, stop_at_instance,
                                                   decisions, bounds)
        if ended or handled:
            return in_flight, True, ended
    limit = None if config.max_in_flight is None else config.max_in_flight - in_flight
    routed, stopped = _route_run(queue.levels[v], v, candidates, config.mu, limit, stop_at_instance, decisions,
                                 bounds)
    return in_flight + routed, routed > 0, stopped


def _single(level: deque[PendingTrajectory]) -> bool:
    """The head of ``level`` has a length of its own (no run of a group's members starts there)."""
    return len(level) == 1 or level[1].length != level[0].length


def _route_singles(queue: _MultiLevelQueue, v: int, candidates: list[_VersionGroup], config: StrategyConfig,
                   in_flight: int, stop_at_instance: str | None, decisions: list[RouteDecision],
                   bounds: WithheldBounds) -> tuple[int, int, bool]:
    """``_route_run`` for the trajectories at the front of level ``v`` that each have a length of
    their own (a steady fleet's partials), in one loop: withheld from a bound where one tells
    (``WithheldBounds``), else routed to, or withheld from, the best instance ``best_free`` finds
    (the exact gains where it cannot tell). Stops at the first that starts a run of one length, at
    ``max_in_flight`` and when the level is done. Returns the trajectories in flight, how many it
    decided and whether the pass ends (a route to ``stop_at_instance``, or a withheld one
    without ``scan_withheld``)."""
    level = queue.levels[v]
    fleet = candidates[0].fleet
    lo, hi = candidates[0].lo, candidates[-1].hi
    whole = lo == 0 and hi == len(fleet.ids)
    mu, limit = config.mu, config.max_in_flight
    ids, append, popleft = fleet.ids, decisions.append, level.popleft
    ideal_gain, best_free, add = fleet.ideal_gain, fleet.best_free, fleet.add_uniform
    withholds, record = bounds.withholds, bounds.record
    handled = 0
    while level and (limit is None or in_flight < limit):
        traj = level[0]
        length = traj.length
        if not _single(level):
            break
        threshold = mu * ideal_gain(length)
        if length == fleet.length or not withholds(lo, length, threshold):
            best = None if length == fleet.length else best_free(length, lo, hi, threshold)
            if best is None:
                gains = fleet.gains if length == fleet.length else fleet.at_length(length)
                i = int(gains.argmax()) if whole else lo + int(gains[lo:hi].argmax())
                best = i, gains.item(i)
            i, gain = best
            if gain >= threshold:
                popleft()
                add(i, length)
                append(_new_tuple(RouteDecision, (ids[i], traj.traj_id, traj.group_id, v, False)))
                in_flight += 1
                handled += 1
                if ids[i] == stop_at_instance:
                    return in_flight, handled, True
                continue
            record(lo, length, gain)
        if not config.scan_withheld:
            return in_flight, handled, True
        queue.withhold(v)
        handled += 1
    return in_flight, handled, False


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
    fleet = candidates[0].fleet
    if fleet.uniform and mu > 0:  # one threshold: the first largest gain of the candidates' slice
        lo, hi = candidates[0].lo, candidates[-1].hi
        gains = fleet.gains if length == fleet.length else fleet.at_length(length)
        i = int(gains.argmax()) if lo == 0 and hi == len(gains) else lo + int(gains[lo:hi].argmax())
        if not gains.item(i) >= mu * fleet.ideal_gain(length):
            return None
        group = candidates[0] if len(candidates) == 1 else next(g for g in candidates if i < g.hi)
        return group, i - group.lo
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
