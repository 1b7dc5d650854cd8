"""Withholding a trajectory from the gains of a shorter one, without evaluating every instance.

On a fleet of one cost model with ``mu > 0`` a versioned trajectory is withheld exactly when no
candidate's marginal gain (Eq. 3) reaches ``mu`` times the ideal gain of its length. An
instance's gain only falls as the length grows, in floating point too: every step of its
arithmetic (``kv + k5 l``, times ``k1``, plus constants, ``(n + 1) /`` that, less the throughput
before) is monotone, and a length that does not fit where a longer one does cannot exist. So the
largest gain at a length a trajectory was withheld at bounds every gain of a longer length while
the instances stay as they were; an instance a trajectory started on since then is evaluated at
that length (in Python floats, the arithmetic of the arrays) and raises the bound if it gains
more (one where a trajectory queued gains nothing any more: below every positive threshold). A
trajectory whose threshold is above a bound of a length no longer than its own is withheld: the
decision the full evaluation makes, without it. Most withheld trajectories of a steady fleet are
long ones after a shorter one was withheld."""

from __future__ import annotations

from typing import Protocol


class ChangingFleet(Protocol):
    """What the bounds read of routing's fleet: the instances changed since the first bound was
    taken, and one instance's gain at a length."""

    changed: list[int] | None

    def gain_of(self, i: int, length: int) -> float: ...

_KEPT = 4  # bounds kept per slice of the fleet: each one is brought up to date after every route


class _Bound:
    __slots__ = ("length", "largest", "seen")

    def __init__(self, length: int, largest: float, seen: int):
        self.length, self.largest, self.seen = length, largest, seen  # seen: len(fleet.changed) when current


class WithheldBounds:
    """The bounds of one routing pass by the start ``lo`` of the candidates' slice of the fleet
    (its newest instances: those at least as new as V_traj). The fleet reports the instances it
    changes in ``changed`` once a bound is taken. Only bounds no other one beats in both length and value are kept."""

    def __init__(self, fleet: ChangingFleet):
        self.fleet = fleet  # its ``changed`` list is started with the first bound: a fill withholds nothing
        self.kept: dict[int, list[_Bound]] = {}

    def record(self, lo: int, length: int, largest: float) -> None:
        """The largest gain of the candidates from ``lo`` at ``length``, now."""
        changed = self.fleet.changed
        if changed is None:
            changed = self.fleet.changed = []
        kept = self.kept.setdefault(lo, [])
        # kept bounds as last brought up to date (an older value only makes a bound look lower:
        # a bound dropped or not taken for it costs an evaluation, never a decision)
        for bound in kept:
            if bound.length <= length and bound.largest <= largest:
                return  # one as short with no larger gain covers every length this one does
        kept[:] = [b for b in kept if not (b.length >= length and b.largest >= largest)]
        kept.append(_Bound(length, largest, len(changed)))
        if len(kept) > _KEPT:
            kept.remove(max(kept, key=lambda b: b.length))

    def withholds(self, lo: int, length: int, threshold: float) -> bool:
        """True when no candidate from ``lo`` gains at least ``threshold`` from ``length``;
        False when one may."""
        for bound in self.kept.get(lo, ()):
            if bound.length <= length and bound.largest < threshold and self._current(lo, bound) < threshold:
                return True
        return False

    def _current(self, lo: int, bound: _Bound) -> float:
        """The bound, raised to the gains of the instances changed since it was last current."""
        fleet = self.fleet
        changed = fleet.changed
        assert changed is not None
        largest = bound.largest
        for i in changed[bound.seen:]:
            if i >= lo:
                gain = fleet.gain_of(i, bound.length)
                if gain > largest:
                    largest = gain
        bound.largest, bound.seen = largest, len(changed)
        return largest
