"""The rollout coordinator: the snapshot-command cycle (paper §5.2, Algorithm 1) over HTTP.

Each cycle captures every instance's snapshot, keeps those that match the speculative state P
(Eq. 1), asks the trajectory server what waits, the ledger what it admits (once) and the
parameter server its newest version, runs the strategies, and issues the commands. Commands for
one instance go through that instance's own queue, so they take effect in the order issued (an
Interrupt before its Pull, a Route after a Pull in progress); queues of different instances run
concurrently. A Route needs its trajectories in the trajectory server, so the partials an
Interrupt returns are handed back before any checkout. A command that fails or times out is not
retried blindly: the instance's P is reconciled from its next snapshot. When an instance joins,
fails or restarts is decided by the pure ``Membership`` rules (``staleflow.coordinator.membership``);
this service carries out the actions they return. Every cycle also reconciles what the trajectory
server has routed with what the instances hold (``staleflow.coordinator.reconcile``), so a lost
message never stalls a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import InstanceView
from staleflow.api.instance import (
    AbortApplied,
    AbortCommand,
    AnyCommand,
    AsyncInstanceClient,
    CommandApplied,
    InterruptApplied,
    InterruptCommand,
    ParamsWeightsIn,
    PullApplied,
    PullCommand,
    RouteCommand,
    SimWeightsIn,
    SnapshotOut,
    WeightsIn,
)
from staleflow.api.manager import AsyncManagerClient
from staleflow.api.params import AsyncParamsClient
from staleflow.api.trajectories import Assignment, AsyncTrajectoryClient, TrajectorySummary
from staleflow.api.trajectory import GeneratedPart
from staleflow.backoff import Backoff
from staleflow.commands import commands_of
from staleflow.config.strategy import PullMode, StrategyConfig, SyncMode
from staleflow.coordinator.learning import InstanceInputs, LearnedLengths, PullDecision
from staleflow.coordinator.membership import Action, InstanceStatus, Liveness, Membership
from staleflow.coordinator.reconcile import Suspicion, reconcile
from staleflow.cost_model import CostModel
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.strategies import (
    DecodeSpeeds,
    InstanceState,
    KvReadings,
    PendingTrajectory,
    SpeculativeState,
    plan_cycle,
)

log = logging.getLogger(__name__)

UNREACHABLE_BACKOFF_CAP = 2.0
"""The longest pause, in seconds, between cycles while a service the cycle needs does not answer."""


@dataclass
class InstanceRecord(Liveness):
    """One instance: its lifecycle (``Liveness``), its last snapshot and its command queue."""

    instance_id: str
    url: str
    client: AsyncInstanceClient
    cost: CostModel
    snapshot: SnapshotOut | None = None
    validated: bool = False
    unvalidated_since: float | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    in_flight: int = 0  # commands queued or running
    worker: asyncio.Task | None = None
    check_orphans: bool = False  # a checkout for it got no answer: the TS may have routed work it never got
    params_url: str | None = None  # where it pulls weights (a relay on its machine), else the job's parameter server
    commands_issued: int = 0  # every command ever queued or sent to it: a snapshot is settled if none came meanwhile
    settled: tuple[int, frozenset[str]] | None = None  # this cycle's settled snapshot: (commands_issued, run + wait)


@dataclass
class CommandRecord:
    command_id: str
    instance_id: str
    kind: str
    size: int
    issued_at: float
    completed_at: float | None = None
    outcome: str = "pending"


@dataclass
class CoordinatorStats:
    cycles: int = 0
    accepted_snapshots: int = 0
    discarded_snapshots: int = 0
    last_decision_ms: float = 0.0
    decision_ms_total: float = 0.0
    decisions: int = 0  # cycles that ran the strategies
    routed: int = 0
    interrupted: int = 0
    pulls: int = 0
    aborts: int = 0
    failures: int = 0
    unreachable: int = 0  # cycles cut short by a service that did not answer (then backed off)
    cycle_ms_total: float = 0.0  # wall time of every cycle, pauses excluded
    rejoined: int = 0  # failed or restarted instances that joined again (a new boot id)
    released: int = 0  # trajectories of failed instances handed back to the trajectory server
    reconciled: int = 0  # routed to an instance that did not hold them: handed back after the grace period
    strays_aborted: int = 0  # held by an instance the trajectory server had not routed them to: aborted there
    rerouted_pulls: int = 0  # Pulls of a version nobody could serve any more, sent again for the newest that exists
    command_count: dict[str, int] = field(default_factory=dict)  # by kind, answered or not
    command_seconds: dict[str, float] = field(default_factory=dict)  # by kind: issued to answered
    phase_ms_total: dict[str, float] = field(default_factory=dict)  # wall time of each step of the cycle, summed

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``phase_ms_total[phase]``: what a cycle spends where."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phase_ms_total[phase] = self.phase_ms_total.get(phase, 0.0) + (time.perf_counter() - started) * 1e3


class Coordinator:
    def __init__(self, manager_url: str, ts_url: str, strategy: StrategyConfig, *, params_url: str | None = None,
                 cycle_period: float, command_timeout: float, failure_timeout: float, stall_timeout: float,
                 reconcile_after: float, sim_weights_bytes: int | None = None):
        """The timeouts and the cycle period have no defaults here: they are declared once, in
        ``staleflow.config.coordinator.CoordinatorSettings``."""
        self.strategy = strategy
        self.manager = AsyncManagerClient(manager_url)
        self.ts = AsyncTrajectoryClient(ts_url, timeout=command_timeout)
        self.params = AsyncParamsClient(params_url) if params_url else None
        self.params_url = str(params_url).rstrip("/") if params_url else None
        self.cycle_period = cycle_period
        self.command_timeout = command_timeout
        self.failure_timeout = failure_timeout
        # what the cycle waits for an instance's answer (its snapshot, an interrupt or abort it
        # issues): no longer than would make the instance silent past the failure timeout
        self.answer_timeout = min(command_timeout, failure_timeout)
        self.stall_timeout = stall_timeout
        self.membership = Membership(failure_timeout, stall_timeout)
        self.reconcile_after = reconcile_after
        self.sim_weights_bytes = sim_weights_bytes
        self.instances: dict[str, InstanceRecord] = {}
        self.p = SpeculativeState()
        self.speeds = DecodeSpeeds()  # each instance's decode speed against the cost model, from its snapshots
        self.kv_readings = KvReadings()  # repack: each instance's KV utilisation at the last repack check
        # length-aware routing and adaptive redundancy: the lengths of finished trajectories, followed
        # from the trajectory server
        self.lengths = LearnedLengths() if strategy.length_aware or strategy.adaptive_redundancy else None
        self._lengths_refused = False  # the trajectory server refused its finished lengths last cycle
        self._surplus: int | None = None  # the ledger's extra groups per buffer (capacity - B), asked once
        self._eta = 0
        self.pull_decisions: deque[PullDecision] = deque(maxlen=200)  # pull: auto, with what each was decided from
        self._repack_due = 0.0 if strategy.migration.repacks else float("inf")  # monotonic time of the next check
        self.refused: dict[str, str] = {}  # instances kept out, and why (repack without KV utilisation)
        self.stats = CoordinatorStats()
        self.commands: deque[CommandRecord] = deque(maxlen=2000)
        self._ids = itertools.count(1)
        self._run_id = f"{int(time.time() * 1000):x}"
        self.ps_version = 0
        # versions whose Pull came back version_unavailable (every holder gone, the PS's copy dropped)
        # -> the newest version that exists, which Pulls name instead until a newer one appears
        self.rerouted: dict[int, int] = {}
        self._stopping = False
        self._suspects: dict[Suspicion, float] = {}  # mismatches between the TS and the instances, since when

    # ------------------------------------------------------------------ membership

    def add_instance(self, instance_id: str, url: str, cost: CostModel | None = None,
                     params_url: str | None = None) -> InstanceRecord:
        """Register an instance (at start or at runtime: elastic pool). It joins after its first
        snapshot is adopted and it has pulled the newest version."""
        old = self.instances.get(instance_id)
        if old is not None:
            if old.status is not InstanceStatus.FAILED:
                raise StaleFlowError(ErrorCode.DUPLICATE_INSTANCE, f"instance {instance_id!r} is already registered")
            if old.worker:
                old.worker.cancel()
        record = InstanceRecord(instance_id, url, AsyncInstanceClient(url, timeout=self.command_timeout),
                                cost or CostModel())
        record.params_url = str(params_url).rstrip("/") if params_url else None
        record.worker = asyncio.create_task(self._command_worker(record))
        self.instances[instance_id] = record
        return record

    async def upsert_instance(self, instance_id: str, url: str, cost: CostModel | None = None,
                              params_url: str | None = None) -> InstanceRecord:
        """Register an instance, or point a registered one at its new address (its process moved
        to another machine). A moved instance is a new process: its new boot id makes the next
        snapshot hand the old process's trajectories back, as after a restart in place."""
        old = self.instances.get(instance_id)
        if old is None:
            return self.add_instance(instance_id, url, cost, params_url)
        old.params_url = str(params_url).rstrip("/") if params_url else None
        if old.url.rstrip("/") == url.rstrip("/"):
            return old  # a restart in place: its new boot id tells the rest
        previous = old.client
        old.url, old.client = url, AsyncInstanceClient(url, timeout=self.command_timeout)
        old.validated = False
        await previous.aclose()
        log.warning("instance %s moved to %s", instance_id, url)
        return old

    async def remove_instance(self, instance_id: str) -> int | None:
        """Take an instance out of the pool: no command goes to it any more, and what the trajectory
        server routed to it goes back to pending (the number handed back; None if the trajectory
        server could not be reached, in which case reconciliation hands them back once the grace
        period has passed). A late completion from it still counts once."""
        record = self.instances.pop(instance_id, None)
        if record is None:
            raise StaleFlowError(ErrorCode.UNKNOWN_INSTANCE, f"instance {instance_id!r} is not registered")
        if record.worker:
            record.worker.cancel()
        self.p.forget(instance_id)
        self.speeds.forget(instance_id)
        await record.client.aclose()
        log.warning("instance %s removed", instance_id)
        try:
            released = (await self.ts.release(instance_id, generated=self._generated(record))).released
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.error("trajectories of removed instance %s could not be handed back yet (%s); reconciliation "
                      "will", instance_id, exc)
            return None
        self.stats.released += released
        return released

    async def close(self) -> None:
        self._stopping = True
        for record in self.instances.values():
            if record.worker:
                record.worker.cancel()
            await record.client.aclose()
        await self.manager.aclose()
        await self.ts.aclose()
        if self.params:
            await self.params.aclose()

    async def _carry_out(self, record: InstanceRecord, actions: list[Action], why: str | None = None) -> bool:
        """Do what the membership rules decided; False if a release could not be done yet."""
        if Action.FORGET in actions:
            record.validated = False
            self.p.forget(record.instance_id)
            if Action.DROP_COMMANDS not in actions:  # a restart is a rejoin, not a failure
                self.stats.failures += 1
                log.warning("instance %s declared failed: %s", record.instance_id, why)
        if Action.DROP_COMMANDS in actions:
            while not record.queue.empty():  # commands meant for the previous process
                record.queue.get_nowait()
                record.in_flight -= 1
        if Action.RELEASE in actions:
            return await self._release(record)
        return True

    async def _release(self, record: InstanceRecord) -> bool:
        """Hand a failed or restarted instance's trajectories back to the trajectory server; a
        failure (the TS restarting) is retried on later cycles until it succeeds."""
        try:
            released = (await self.ts.release(record.instance_id, generated=self._generated(record))).released
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.error("trajectories of %s could not be released yet (%s); retrying", record.instance_id, exc)
            return False
        self.membership.released(record)
        self.stats.released += released
        log.warning("%d trajectories of %s back to the trajectory server", released, record.instance_id)
        return True

    @staticmethod
    def _generated(record: InstanceRecord) -> dict[str, int]:
        """The response tokens each trajectory held on the instance at its last snapshot (at most a
        cycle old): the trajectory server counts what lies beyond their checkpoints as regenerated."""
        snapshot = record.snapshot
        return dict(snapshot.generated or {}) if snapshot is not None else {}

    async def _rejoin(self, record: InstanceRecord, snap: SnapshotOut, why: str) -> bool:
        """A restarted instance (a new boot id): what was routed to its previous process is
        lost there, so it goes back to pending; the new process joins like a new instance."""
        if not await self._carry_out(record, self.membership.begin_rejoin(record)):
            return False
        self.membership.rejoin(record, snap.boot_id, time.monotonic())
        record.unvalidated_since = None
        self.stats.rejoined += 1
        log.warning("instance %s rejoins: %s", record.instance_id, why)
        return True

    # ------------------------------------------------------------------ the cycle

    async def run(self) -> None:
        # a service that is down (restarting, reloading) is tried again after a growing, jittered pause
        backoff = Backoff(self.cycle_period, max(self.cycle_period, UNREACHABLE_BACKOFF_CAP))
        while not self._stopping:
            started = time.monotonic()
            pause = None
            try:
                await self.cycle()
            except httpx.TransportError as exc:  # a peer restarting: the next cycle tries again
                self.stats.unreachable += 1
                pause = backoff.failed()
                log.warning("coordinator cycle: a service is unreachable (%s: %s); next try in %.2fs",
                            exc.__class__.__name__, exc.request.url if exc.__dict__.get("_request") else "", pause)
            except Exception:
                log.exception("coordinator cycle failed; continuing")
            self.stats.cycle_ms_total += (time.monotonic() - started) * 1e3
            if pause is None:
                backoff.succeeded()
                pause = max(0.0, self.cycle_period - (time.monotonic() - started))
            await asyncio.sleep(pause)  # cycle pacing, or backoff from a service that is down

    async def cycle(self) -> None:
        self.stats.cycles += 1
        timed = self.stats.timed
        with timed("snapshots"):
            await self._capture()
        with timed("cancellations"):
            await self._cancel_surplus()
        with timed("routed"):
            routed = (await self.ts.routed()).trajectories
        with timed("reconcile"):
            if await self._reconcile(routed):
                return  # the views changed: plan on the next cycle's
        ready = [r for r in self.instances.values() if r.validated and r.status is InstanceStatus.LIVE and r.in_flight == 0]
        if not ready:
            return
        with timed("pending"):
            pending_reply = await self.ts.pending()
        with timed("admission"):
            try:
                admission = (await self.manager.admission()).by_version()
            except httpx.TransportError:  # the manager is restarting: route only groups it already reserved
                admission = {}
        with timed("ps_version"):
            try:
                version = await self._ps_version()
                if version > self.ps_version and self.strategy.migration.repacks:
                    self._repack_due = 0.0  # a repack check follows every new version
                self.ps_version = version
            except httpx.TransportError:  # the PS is restarting: its newest version is the one last seen
                pass
        pending = [self._pending(t) for t in pending_reply.trajectories]
        on_instances = {t.traj_id: self._pending(t) for t in routed}
        if self.lengths is not None:
            with timed("lengths"):
                pending, on_instances = await self._predict_lengths(pending_reply.trajectories, routed)
                if self.strategy.adaptive_redundancy:
                    admission = await self._spare(admission, [*pending, *on_instances.values()])
        states = [self._state(r, observe=True) for r in ready]
        if self.strategy.sync is SyncMode.GLOBAL and any(
                r.status is not InstanceStatus.FAILED and not (r.validated and r in ready) for r in self.instances.values()):
            states = [s for s in states if s.version >= self.ps_version]  # a global sync waits for everyone
        repack_previous = self._repack_check(states)
        started = time.perf_counter()
        plan = plan_cycle(states, pending, self.ps_version, admission, self.strategy, on_instances,
                          repack_previous=repack_previous)
        elapsed = (time.perf_counter() - started) * 1e3
        self.stats.last_decision_ms = elapsed
        self.stats.decision_ms_total += elapsed
        self.stats.decisions += 1
        if self.strategy.pull is PullMode.AUTO and plan.syncs:
            self._record_pulls(plan.syncs, set(plan.kept), states)
        if not plan.empty:
            with timed("issue"):
                await self._issue(plan)

    def _repack_check(self, states: list[InstanceState]) -> dict[str, float] | None:
        """On a repack check (every ``repack_period_s``, and in the cycle after a new version):
        the readings of the last one, and this one's recorded; otherwise None."""
        now = time.monotonic()
        if now < self._repack_due:
            return None
        previous = self.kv_readings.previous()
        self.kv_readings.record(states)
        self._repack_due = now + self.strategy.repack_period_s
        return previous

    async def _predict_lengths(self, waiting: list[TrajectorySummary], routed: list[TrajectorySummary]
                               ) -> tuple[list[PendingTrajectory], dict[str, PendingTrajectory]]:
        """Learn the lengths finished since the last cycle, then predict each unfinished
        trajectory's remainder (``LearnedLengths``); a trajectory server without the feed (an
        older one) leaves the predictor at its prior."""
        assert self.lengths is not None
        try:
            self.lengths.take(await self.ts.finished_lengths(after=self.lengths.cursor, limit=10_000))
            self._lengths_refused = False
        except ServiceError as exc:
            if not self._lengths_refused:  # once until it answers again: not every cycle
                log.warning("the trajectory server's finished lengths cannot be read (%s): predicting from what "
                            "was learned", exc.detail)
            self._lengths_refused = True
        generated = {t.traj_id: t.generated for t in waiting}
        for t in routed:  # an instance's snapshot is newer than the trajectory server's last checkpoint
            record = self.instances.get(t.instance_id or "")
            live = record.snapshot.generated if record is not None and record.snapshot is not None else None
            generated[t.traj_id] = max(t.generated, (live or {}).get(t.traj_id, 0))
        summaries = waiting + routed
        prompts = {t.group_id: t.prompt_key for t in summaries}
        predicted = self.lengths.with_remainders([self._pending(t) for t in summaries], generated, prompts)
        self.lengths.forget_except(prompts)
        return predicted[:len(waiting)], {t.traj_id: t for t in predicted[len(waiting):]}

    async def _spare(self, admission: dict[int, int], predicted: list[PendingTrajectory]) -> dict[int, int]:
        """Adaptive redundancy: the admission table less the extra groups the predicted tail does
        not call for (``LearnedLengths.spare_admission``)."""
        assert self.lengths is not None
        if self._surplus is None:
            buffers = await self.manager.buffers()
            if not buffers.buffers:
                return admission
            self._surplus, self._eta = buffers.buffers[0].capacity - buffers.batch_size, buffers.eta
        return self.lengths.spare_admission(admission, predicted, self.strategy, self._eta, self._surplus)

    def _record_pulls(self, syncs: list[str], kept: set[str], states: list[InstanceState]) -> None:
        """Keep each ``pull: auto`` choice with the inputs it was made from."""
        inputs = {}
        for state in states:
            snap = self.instances[state.instance_id].snapshot
            inputs[state.instance_id] = InstanceInputs(snap.decode_steps if snap else None,
                                                       snap.decode_seconds if snap else None, state.speed,
                                                       state.kv_cache, len(state.running))
        for instance_id in syncs:
            self.pull_decisions.append(PullDecision(instance_id, self.ps_version, instance_id in kept, inputs))

    @staticmethod
    def _pending(t: TrajectorySummary) -> PendingTrajectory:
        return PendingTrajectory(t.traj_id, t.group_id, t.v_traj, t.length, t.seq)

    def _state(self, record: InstanceRecord, observe: bool = False) -> InstanceState:
        """The instance as the strategies see it; ``observe``: its snapshot also updates the decode
        speed estimate (the planning cycle's reading; inspection and scrapes only read it)."""
        s = record.snapshot
        if s is None:
            return InstanceState(record.instance_id, 0, 0.0, [], [], record.cost)
        speed = self.speeds.observe(record.instance_id, s.decode_steps, s.decode_seconds, float(s.kv_cache),
                                    len(s.run_trajs), record.cost) if observe else self.speeds.speed(record.instance_id)
        return InstanceState(record.instance_id, s.inst_version, float(s.kv_cache), list(s.run_trajs),
                             list(s.wait_trajs), record.cost, speed, s.kv_usage)

    async def _ps_version(self) -> int:
        if self.params is None:  # no parameter server: a version exists once its buffer is consumed
            return (await self.manager.buffers()).train_version
        try:
            return (await self.params.latest()).version
        except ServiceError:  # nothing pushed yet
            return self.ps_version

    async def _capture(self) -> None:
        now = time.monotonic()
        for record in list(self.instances.values()):
            if record.status is InstanceStatus.FAILED and not record.released:
                await self._release(record)
        records = [r for r in self.instances.values() if self.membership.to_probe(r, now)]
        for record in self.instances.values():
            record.settled = None
        quiet = {r.instance_id: r.commands_issued for r in records if r.in_flight == 0}
        replies = await asyncio.gather(*(self._snapshot(r) for r in records), return_exceptions=True)
        now = time.monotonic()
        for record, reply in zip(records, replies, strict=True):
            snapshot = reply if isinstance(reply, SnapshotOut) else None
            if snapshot and quiet.get(record.instance_id) == record.commands_issued and record.in_flight == 0:
                record.settled = (record.commands_issued, frozenset(snapshot.run_trajs) | frozenset(snapshot.wait_trajs))
            if record.status is InstanceStatus.FAILED:
                # a failed instance stays out until its process is replaced (a supervisor restarted it)
                if snapshot and self.membership.restarted(record, snapshot.boot_id):
                    if await self._rejoin(record, snapshot, "restarted after it was declared failed"):
                        self._observe(record, snapshot, now)
                continue
            if snapshot is None:
                record.validated = False
                await self._carry_out(record, *self.membership.silent(record, now))
                continue
            if self.membership.restarted(record, snapshot.boot_id):
                # restarted before it was declared failed: the same port, a new process
                if not await self._rejoin(record, snapshot, "restarted (a new process at the same address)"):
                    continue
            record.last_seen = now
            if record.status is InstanceStatus.JOINING and self._refuses(record, snapshot):
                continue
            if record.status is InstanceStatus.JOINING and not await self._return_orphans(record, snapshot):
                continue  # the trajectory server is unreachable: join on a later cycle
            if record.check_orphans and record.in_flight == 0 and await self._return_orphans(record, snapshot):
                record.check_orphans = False
            await self._carry_out(record, *self._observe(record, snapshot, now))

    def _refuses(self, record: InstanceRecord, snap: SnapshotOut) -> bool:
        """Repack tells an instance's ramp-down by the KV utilisation its engine reports: with repack
        configured, an instance that reports none is not let in (else repack would silently never
        move its work), and why is logged once and kept in ``refused``."""
        if not self.strategy.migration.repacks or snap.kv_usage is not None:
            self.refused.pop(record.instance_id, None)
            return False
        if record.instance_id not in self.refused:
            why = (f"migration {self.strategy.migration.value} repacks by KV utilisation, which instance "
                   f"{record.instance_id} does not report (an engine with its stats off, or an older instance "
                   "server): turn the engine's stats on, or choose migration: starved")
            self.refused[record.instance_id] = why
            log.error("instance %s not admitted: %s", record.instance_id, why)
        return True

    async def _reconcile(self, routed: list[TrajectorySummary]) -> bool:
        """Make the trajectory server's view of what runs where and the instances' agree again
        (``staleflow.coordinator.reconcile``): trajectories routed to an instance that has not
        held them for ``reconcile_after`` seconds go back to pending, and trajectories an instance
        holds without the trajectory server routing them there are aborted on it. True if
        anything was done."""
        held: dict[str, frozenset[str] | None] = {}
        for record in self.instances.values():
            settled = record.settled
            fresh = (settled is not None and record.status is InstanceStatus.LIVE and record.in_flight == 0
                     and settled[0] == record.commands_issued)
            held[record.instance_id] = settled[1] if settled is not None and fresh else None
        outcome = reconcile(time.monotonic(), self.reconcile_after,
                            {t.traj_id: t.instance_id for t in routed if t.instance_id}, held,
                            self._suspects)
        self._suspects = outcome.suspects
        for instance_id, traj_ids in outcome.hand_back.items():
            await self.ts.give_back(instance_id=instance_id, partials=[GeneratedPart(traj_id=t) for t in traj_ids])
            self.stats.reconciled += len(traj_ids)
            log.warning("%d trajectories routed to %s but not held there for %.0fs: back to pending", len(traj_ids),
                        instance_id, self.reconcile_after)
        for instance_id, traj_ids in outcome.abort.items():
            log.warning("%s holds %d trajectories the trajectory server has not routed to it: aborting them there",
                        instance_id, len(traj_ids))
            record = self.instances.get(instance_id)
            reply = record and await self._command(record, AbortCommand(command_id=self._command_id(), traj_ids=traj_ids))
            if isinstance(reply, AbortApplied):
                self.stats.strays_aborted += len(reply.aborted)
        return not outcome.empty

    async def _return_orphans(self, record: InstanceRecord, snap: SnapshotOut) -> bool:
        """Before an instance joins (at start, after a restart of it or of this coordinator):
        trajectories the trajectory server believes routed to it but that it does not hold were
        checked out by a coordinator that died before its Route arrived. They go back to pending
        (their generated tokens kept); a completion that arrives later still counts once."""
        held = set(snap.run_trajs) | set(snap.wait_trajs) | set(snap.complete_trajs)
        try:
            routed = (await self.ts.routed(instance_id=record.instance_id)).trajectories
            orphans = [t.traj_id for t in routed if t.traj_id not in held]
            if orphans:
                await self.ts.give_back(instance_id=record.instance_id, partials=[GeneratedPart(traj_id=t) for t in orphans])
                self.stats.released += len(orphans)
                log.warning("%d trajectories routed to %s but not there: back to pending", len(orphans),
                            record.instance_id)
        except (httpx.HTTPError, ServiceError, ValueError) as exc:
            log.warning("cannot check %s's trajectories yet (%s)", record.instance_id, exc)
            return False
        return True

    async def _snapshot(self, record: InstanceRecord) -> SnapshotOut:
        return await record.client.snapshot(timeout=self.answer_timeout)

    def _observe(self, record: InstanceRecord, snap: SnapshotOut, now: float) -> tuple[list[Action], str | None]:
        """Take in a snapshot; returns what the membership rules decided about a stall."""
        record.snapshot = snap
        run, wait, done = set(snap.run_trajs), set(snap.wait_trajs), set(snap.complete_trajs)
        mark = (snap.kv_cache, len(run), len(wait), len(done), snap.inst_version, snap.engine_time)
        stalled = self.membership.seen(record, now, mark, running=bool(run))
        joined = self.membership.join(record, snap.inst_version, self.ps_version, idle=not (run or wait))
        if Action.ADOPT in joined:
            self.p.adopt(record.instance_id, snap.inst_version, len(run | wait | done))
        if Action.PULL in joined:  # a (re)joining instance starts from the newest weights
            self.p.pulled(record.instance_id, self._pull_target())
            self._enqueue(record, self._pull(record))
        if record.in_flight:
            record.validated = False
            return stalled
        record.validated = self.p.validates(record.instance_id, snap.inst_version, run, wait, done)
        if record.validated:
            self.stats.accepted_snapshots += 1
            record.unvalidated_since = None
        else:
            self.stats.discarded_snapshots += 1
            record.unvalidated_since = record.unvalidated_since or now
            if now - record.unvalidated_since > self.reconcile_after:
                # nothing in flight and still no match: a command's effect was lost; trust the instance
                log.info("reconciling %s from its snapshot", record.instance_id)
                self.p.adopt(record.instance_id, snap.inst_version, len(run | wait | done))
                record.unvalidated_since = None
        return stalled

    # ------------------------------------------------------------------ issuing commands

    async def _issue(self, plan) -> None:
        commands = commands_of(plan)
        repacked = {m.source for m in plan.repacks}
        # 1. interrupts (syncs', migrations' and repacks'): partials go back to the trajectory server
        # first. A repack whose source does not answer moves nothing: its Routes are dropped (the
        # trajectories stay where they are, or go back to pending if the source is declared failed,
        # and are routed by a later cycle like any other).
        interrupted = await asyncio.gather(*(
            self._command(self.instances[i], InterruptCommand(command_id=self._command_id(), traj_ids=trajs),
                          shown="repack" if i in repacked else None)
            for i, trajs in commands.interrupts.items()))
        unmoved: set[str] = set()
        for instance_id, reply in zip(commands.interrupts, interrupted, strict=True):
            if isinstance(reply, InterruptApplied) and reply.partials:
                await self.ts.give_back(instance_id=instance_id, partials=reply.partials)
            elif reply is None and instance_id in repacked:
                unmoved.update(commands.interrupts[instance_id])
        # 2. pulls: queued on their instance; routes to it wait behind them
        for instance_id in commands.pulls:
            record = self.instances[instance_id]
            if record.status is InstanceStatus.FAILED:  # silent to its interrupt
                continue
            self.membership.sync_started(record)
            self.p.pulled(instance_id, self._pull_target())
            self._enqueue(record, self._pull(record, keep_running=instance_id in commands.kept))
        # 3. routes: check out payloads (reserving new groups in the ledger), then queue them
        for instance_id, assignments in commands.routes.items():
            assignments = [(t, v) for t, v in assignments if t not in unmoved]
            if not assignments or self.instances[instance_id].status is InstanceStatus.FAILED:  # silent to its interrupt
                continue
            try:
                trajectories = (await self.ts.checkout(
                    instance_id=instance_id, assignments=[Assignment(traj_id=t, v_traj=v) for t, v in assignments])
                                ).trajectories
            except ServiceError:
                trajectories = []
            except httpx.TransportError:
                # the TS may have committed the checkout and died before answering: what it routed
                # there never reaches the instance; compare with the instance's next snapshot
                self.instances[instance_id].check_orphans = True
                raise
            if trajectories:
                self.p.routed(instance_id, len(trajectories))
                self._enqueue(self.instances[instance_id],
                              RouteCommand(command_id=self._command_id(), trajectories=trajectories))

    def _pull_target(self) -> int:
        """The version a Pull names: the newest, unless nobody can serve it any more (then the
        newest version that exists, until a newer one is pushed)."""
        return self.rerouted.get(self.ps_version, self.ps_version)

    async def _reroute_pull(self, record: InstanceRecord, pull: PullCommand) -> None:
        """A Pull came back ``version_unavailable``: pull the newest version the parameter server
        (as reference server) says exists instead; the staleness bound admits it or the ledger
        keeps its groups waiting, as for any instance behind."""
        if self.params is None:
            return
        try:
            available = (await self.params.references()).available
        except (ServiceError, httpx.HTTPError) as exc:
            log.warning("version %d is unavailable and the parameter server did not say which exist: %s", pull.version, exc)
            return
        target = max((v for v in available if v < pull.version), default=None)
        if target is None:
            log.warning("version %d is unavailable and no older version exists; the next cycle pulls again", pull.version)
            return
        log.warning("version %d is unavailable (no holder, no copy): %s pulls version %d instead",
                    pull.version, record.instance_id, target)
        self.rerouted[pull.version] = target
        self.stats.rerouted_pulls += 1
        if record.instance_id in self.p:  # adopted (its first snapshot): what it holds after the Pull
            self.p.pulled(record.instance_id, target)
        self._enqueue(record, pull.model_copy(update={"command_id": self._command_id(), "version": target}))

    def _command_id(self) -> str:
        return f"{self._run_id}-{next(self._ids)}"

    def _pull(self, record: InstanceRecord, keep_running: bool = False) -> PullCommand:
        """A Pull of the newest version (``_pull_target``) from where ``record`` pulls weights."""
        return PullCommand(command_id=self._command_id(), version=self._pull_target(), weights=self._weights(record),
                           keep_running=keep_running)

    def _weights(self, record: InstanceRecord) -> WeightsIn | None:
        if self.params is None or self.params_url is None:
            return SimWeightsIn(size_bytes=self.sim_weights_bytes) if self.sim_weights_bytes else None
        return ParamsWeightsIn(url=record.params_url or self.params_url)

    async def _cancel_surplus(self) -> None:
        by_instance: dict[str, list[str]] = {}
        for t in (await self.ts.cancellations()).trajectories:
            record = self.instances.get(t.instance_id or "")
            if record and record.status is not InstanceStatus.FAILED and record.validated and record.in_flight == 0:
                by_instance.setdefault(record.instance_id, []).append(t.traj_id)
        for instance_id, traj_ids in by_instance.items():
            record = self.instances.get(instance_id)
            reply = record and await self._command(record, AbortCommand(command_id=self._command_id(), traj_ids=traj_ids))
            if reply:
                await self.ts.cancellations_ack(traj_ids=traj_ids)

    def _enqueue(self, record: InstanceRecord, command: RouteCommand | PullCommand) -> None:
        record.in_flight += 1
        record.commands_issued += 1
        record.queue.put_nowait(command)

    async def _command_worker(self, record: InstanceRecord) -> None:
        while True:
            command: RouteCommand | PullCommand = await record.queue.get()
            try:
                await self._command(record, command, queued=True)
            finally:
                record.in_flight -= 1
                if command.kind == "pull":
                    self.membership.sync_ended(record)

    async def _command(self, record: InstanceRecord, command: AnyCommand,
                       queued: bool = False, shown: str | None = None) -> CommandApplied | None:
        """Send one command; returns its reply, or None when it was refused or its effect is unknown.
        ``shown``: the kind it is listed and counted as (a repack's Interrupt: ``repack``)."""
        if not queued:
            record.in_flight += 1
            record.commands_issued += 1
        kind = command.kind
        size = (len(command.trajectories) if isinstance(command, RouteCommand)
                else len(command.traj_ids) if isinstance(command, InterruptCommand | AbortCommand) else 1)
        entry = CommandRecord(command.command_id, record.instance_id, shown or kind, size, time.time())
        self.commands.append(entry)
        if kind in ("interrupt", "abort"):
            self.p.removed(record.instance_id, size)
        refused: ServiceError | None = None
        try:
            # a queued command (a pull, a route) may take long; one the cycle waits on holds up every
            # instance's next snapshot, so a hung instance must not hold it longer than a snapshot would
            reply = await record.client.command(command, timeout=self.command_timeout if queued else self.answer_timeout)
        except ServiceError as exc:
            refused = exc
        except (httpx.HTTPError, ValueError) as exc:
            entry.outcome = f"unknown: {exc.__class__.__name__}"
            record.unvalidated_since = time.monotonic() - self.reconcile_after  # reconcile from the next snapshot
            if isinstance(command, RouteCommand):
                with contextlib.suppress(ServiceError):
                    await self.ts.give_back(instance_id=record.instance_id, partials=command.trajectories)
            if not queued and isinstance(exc, httpx.TransportError):
                await self._carry_out(record, *self.membership.silent(record, time.monotonic(), f"answer to {kind}"))
            return None
        finally:
            entry.completed_at = time.time()
            self.stats.command_count[entry.kind] = self.stats.command_count.get(entry.kind, 0) + 1
            self.stats.command_seconds[entry.kind] = (self.stats.command_seconds.get(entry.kind, 0.0)
                                                      + entry.completed_at - entry.issued_at)
            if not queued:
                record.in_flight -= 1
        if refused is not None:
            entry.outcome = f"refused: {refused.body.get('code')}: {refused.detail}"
            record.unvalidated_since = time.monotonic() - self.reconcile_after
            if isinstance(command, PullCommand) and refused.code is ErrorCode.VERSION_UNAVAILABLE:
                await self._reroute_pull(record, command)
            return None
        entry.outcome = "ok"
        if isinstance(reply, InterruptApplied | AbortApplied):
            missing = len(reply.not_found)
            self.p.removed(record.instance_id, -missing)  # completed meanwhile: still counted there
            self.stats.interrupted += size - missing if kind == "interrupt" else 0
            self.stats.aborts += size - missing if kind == "abort" else 0
        elif kind == "route":
            self.stats.routed += size
        elif kind == "pull":
            self.stats.pulls += 1
            # a Pull that kept its trajectories: they count among what the instance holds (P was reset when issued)
            if isinstance(reply, PullApplied) and reply.kept and record.instance_id in self.p:
                self.p.routed(record.instance_id, len(reply.kept))
        return reply

    # ------------------------------------------------------------------ inspection

    def describe(self, record: InstanceRecord) -> InstanceView:
        s = record.snapshot
        expected = self.p.expected(record.instance_id) if record.instance_id in self.p else None
        return InstanceView(
            instance_id=record.instance_id,
            url=record.url,
            params_url=record.params_url or self.params_url,
            status=record.status.value,
            validated=record.validated,
            snapshot=s.model_dump(include={"kv_cache", "kv_usage", "run_trajs", "wait_trajs", "complete_trajs",
                                           "inst_version", "seq", "timestamp"}) if s else None,
            speculative={"inst_version": expected.inst_version, "accum_traj_num": expected.accum_traj_num}
            if expected else None,
            estimated_throughput=self._state(record).throughput() if s else 0.0,
            commands_in_flight=record.in_flight,
            refused=self.refused.get(record.instance_id),
        )
