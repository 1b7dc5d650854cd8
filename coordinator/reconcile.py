"""Reconciling the trajectory server's view of what runs where with what the instances hold, pure.

Messages get lost: a completion the instance dropped, a hand-back the trajectory server lost in a
restart, a Route that arrived after the coordinator gave up on it. Two views must then agree
again, or a job stalls:

* **missing** -- the trajectory server lists a trajectory as routed to an instance whose settled
  snapshots do not show it running or waiting (finished there but never delivered counts as
  missing: the completion is lost), or routed to an instance the coordinator does not know. Once
  that has held for longer than the grace period, it is **handed back**: pending again, with the
  progress the trajectory server holds for it, as after an interrupt. A completion that arrives
  later still counts once (the trajectory server takes the first).
* **stray** -- an instance runs (or queues) a trajectory the trajectory server does not list as
  routed to it (it is pending, routed elsewhere, finished or unknown). Once that has held for longer
  than the grace period, it is **aborted** on that instance, so each trajectory runs in at most one
  place and the instances hold no more than the trajectory server accounts for.

A snapshot is *settled* when no command to its instance was queued, in flight or issued while it
was taken: only settled snapshots confirm or clear a suspicion. A suspicion must be confirmed by a
settled snapshot in the round that acts on it, and a settled snapshot showing the views agree
clears it. The grace period covers the ordinary races (a completion delivered between the snapshot
and the trajectory server's list), which resolve within a cycle or two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Mismatch(StrEnum):
    MISSING = "missing"  # routed to the instance by the trajectory server, not held there
    STRAY = "stray"  # held by the instance, not routed to it by the trajectory server


Suspicion = tuple[Mismatch, str, str]
"""(kind, trajectory id, instance id)."""


@dataclass(frozen=True)
class Reconciliation:
    hand_back: dict[str, list[str]] = field(default_factory=dict)  # instance -> trajectories back to pending
    abort: dict[str, list[str]] = field(default_factory=dict)  # instance -> trajectories to abort there
    suspects: dict[Suspicion, float] = field(default_factory=dict)  # still suspected, since when

    @property
    def empty(self) -> bool:
        return not self.hand_back and not self.abort


def reconcile(now: float, grace: float, routed: Mapping[str, str], held: Mapping[str, frozenset[str] | None],
              suspects: Mapping[Suspicion, float]) -> Reconciliation:
    """One round. ``routed``: trajectory id -> the instance the trajectory server routed it to.
    ``held``: for every instance the coordinator knows, what its settled snapshot shows running or
    waiting this round, or None when it has no settled snapshot this round (unknown: suspicions
    about it are kept, neither confirmed nor cleared). ``suspects``: the previous round's."""
    observed: dict[Suspicion, bool] = {}  # suspicion -> confirmed (True) or cleared (False) this round
    for traj_id, instance_id in routed.items():
        if instance_id not in held:
            observed[(Mismatch.MISSING, traj_id, instance_id)] = True
        elif (running := held[instance_id]) is not None:
            observed[(Mismatch.MISSING, traj_id, instance_id)] = traj_id not in running
    for instance_id, running in held.items():
        for traj_id in running or ():
            observed[(Mismatch.STRAY, traj_id, instance_id)] = routed.get(traj_id) != instance_id

    kept: dict[Suspicion, float] = {}
    for suspicion, since in suspects.items():
        kind, traj_id, instance_id = suspicion
        unseen = suspicion not in observed and instance_id in held and held[instance_id] is None
        if unseen and (kind is Mismatch.STRAY or routed.get(traj_id) == instance_id):
            kept[suspicion] = since  # no settled look at that instance this round, and still routed there
    hand_back: dict[str, list[str]] = {}
    abort: dict[str, list[str]] = {}
    for suspicion, confirmed in observed.items():
        if not confirmed:
            continue
        kind, traj_id, instance_id = suspicion
        since = suspects.get(suspicion, now)
        if now - since <= grace:
            kept[suspicion] = since
        elif kind is Mismatch.MISSING:
            hand_back.setdefault(instance_id, []).append(traj_id)
        else:
            abort.setdefault(instance_id, []).append(traj_id)
    return Reconciliation(hand_back, abort, kept)
