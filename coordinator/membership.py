"""The rollout instances' lifecycle, pure: when an instance joins, is live, syncs, has failed or
has restarted, decided from its snapshots (or their absence) and the time. No I/O: each decision
changes the instance's ``Liveness`` and returns the ``Action``s the coordinator service then
carries out (``staleflow.coordinator.service``).

The transitions (``TRANSITIONS``, FROM -> TO, each with why)::

    joining --first snapshot adopted--> live
    joining --first snapshot, behind the newest version, idle--> syncing   (pull first)
    live --a pull issued--> syncing --the pull ended--> live
    joining/live/syncing --silent past the failure timeout (no snapshot, or no answer to a command
                          the cycle waits on)--> failed
    joining/live/syncing --work in hand, no progress past the stall timeout--> failed
    joining/live/syncing --a new boot id (restarted)--> failed --its work released--> joining
    failed --a new boot id, its work released--> joining

Stall versus slow: progress is any change of the snapshot's KV use, counts, version or engine
clock; an idle instance (nothing running) is never stalled, however long it idles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class InstanceStatus(StrEnum):
    JOINING = "joining"  # registered, first snapshot not yet adopted
    LIVE = "live"
    SYNCING = "syncing"  # a Pull is in flight
    FAILED = "failed"


class Action(StrEnum):
    FORGET = "forget"  # drop the instance's speculative state P
    DROP_COMMANDS = "drop_commands"  # commands queued for a process that is gone
    RELEASE = "release"  # hand its trajectories back to the trajectory server (retried until done)
    RETURN_ORPHANS = "return_orphans"  # before joining: routed to it, not held by it -> back to pending
    ADOPT = "adopt"  # take its snapshot as P
    PULL = "pull"  # load the newest weights before anything is routed to it


S = InstanceStatus
TRANSITIONS: dict[tuple[InstanceStatus, InstanceStatus], str] = {
    (S.JOINING, S.LIVE): "first snapshot adopted",
    (S.JOINING, S.SYNCING): "first snapshot adopted; behind the newest version and idle: pull first",
    (S.LIVE, S.SYNCING): "a pull issued",
    (S.SYNCING, S.LIVE): "the pull ended",
    (S.JOINING, S.FAILED): "silent, stalled or restarted",
    (S.LIVE, S.FAILED): "silent, stalled or restarted",
    (S.SYNCING, S.FAILED): "silent, stalled or restarted",
    (S.FAILED, S.JOINING): "a new process (boot id) whose predecessor's work is released",
}
"""Every status change there is; ``Liveness.move`` refuses any other."""
del S


@dataclass(kw_only=True)
class Liveness:
    """What the lifecycle knows of one instance."""

    status: InstanceStatus = InstanceStatus.JOINING
    boot_id: str | None = None  # the instance process's identity: a new one means it restarted
    last_seen: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    progress_mark: tuple | None = None
    released: bool = True  # False: failed, but its trajectories could not be handed back yet
    next_probe: float = 0.0  # a failed instance is probed at most once per probe period

    def move(self, to: InstanceStatus) -> None:
        if to is not self.status and (self.status, to) not in TRANSITIONS:
            raise ValueError(f"an instance cannot go from {self.status} to {to}")
        self.status = to


@dataclass(frozen=True)
class Membership:
    """The lifecycle rules, with their timeouts (seconds; ``stall_timeout`` 0: never stalled)."""

    failure_timeout: float
    stall_timeout: float
    probe_period: float = 1.0

    def to_probe(self, live: Liveness, now: float) -> bool:
        """Whether to ask for its snapshot this cycle (a failed one: once per probe period)."""
        if live.status is not InstanceStatus.FAILED:
            return True
        if live.next_probe > now:
            return False
        live.next_probe = now + self.probe_period
        return True

    def fail(self, live: Liveness) -> list[Action]:
        """Declare it failed: forget its P, hand its work back."""
        if live.status is InstanceStatus.FAILED:
            return []
        live.move(InstanceStatus.FAILED)
        live.released = False
        return [Action.FORGET, Action.RELEASE]

    def silent(self, live: Liveness, now: float, unanswered: str = "snapshot") -> tuple[list[Action], str | None]:
        """No answer to a snapshot this cycle, or to a command the cycle waited on
        (``unanswered`` names it): failed once silent past the failure timeout."""
        if live.status is InstanceStatus.FAILED or now - live.last_seen <= self.failure_timeout:
            return [], None
        return self.fail(live), f"no {unanswered} for {now - live.last_seen:.1f}s"

    def restarted(self, live: Liveness, boot_id: str | None) -> bool:
        """Whether a snapshot with ``boot_id`` comes from a new process (the first one seen is
        adopted as its identity)."""
        if not boot_id:
            return False
        if live.boot_id is None and live.status is not InstanceStatus.FAILED:
            live.boot_id = boot_id
            return False
        return boot_id != live.boot_id

    def begin_rejoin(self, live: Liveness) -> list[Action]:
        """A new process: what was routed to its predecessor is lost there."""
        actions = self.fail(live) or [Action.FORGET, Action.RELEASE]
        live.released = False
        return [*actions, Action.DROP_COMMANDS]

    def released(self, live: Liveness) -> None:
        live.released = True

    def rejoin(self, live: Liveness, boot_id: str | None, now: float) -> None:
        """Its predecessor's work is released: the new process joins like a new instance."""
        assert live.released, "rejoin only once the predecessor's work is back"
        live.boot_id = boot_id
        live.move(InstanceStatus.JOINING)
        live.progress_mark = None
        live.last_seen = live.last_progress = now

    def seen(self, live: Liveness, now: float, mark: tuple, running: bool) -> tuple[list[Action], str | None]:
        """A snapshot of a live (or joining, syncing) instance: it is alive; it progressed if
        ``mark`` changed or nothing runs there. Failed once it stalled with work in hand."""
        live.last_seen = now
        if mark != live.progress_mark or not running:
            live.progress_mark, live.last_progress = mark, now
        if self.stall_timeout and now - live.last_progress > self.stall_timeout:
            return self.fail(live), f"no progress for {now - live.last_progress:.1f}s with work in hand"
        return [], None

    def join(self, live: Liveness, inst_version: int, newest: int, idle: bool) -> list[Action]:
        """The first snapshot is adopted; an idle instance behind the newest version pulls first."""
        if live.status is not InstanceStatus.JOINING:
            return []
        if inst_version < newest and idle:
            live.move(InstanceStatus.SYNCING)
            return [Action.ADOPT, Action.PULL]
        live.move(InstanceStatus.LIVE)
        return [Action.ADOPT]

    def sync_started(self, live: Liveness) -> None:
        live.move(InstanceStatus.SYNCING)

    def sync_ended(self, live: Liveness) -> None:
        if live.status is InstanceStatus.SYNCING:
            live.move(InstanceStatus.LIVE)
