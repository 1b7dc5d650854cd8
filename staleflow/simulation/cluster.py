"""A whole RL job on a virtual clock: rollout instances, trajectory pool, ledger, coordinator, trainer.

Pure and in-process (no HTTP, no threads): paper-scale jobs take seconds of wall time.

* **Rollout**: ``rollout_instances`` ``SimCore`` engines share one virtual clock. They are advanced
  lazily, each to its own next event (admission, completion, preemption, end of a Pull), and all
  of them to the cycle time before a snapshot, so snapshots are exact.
* **Trajectory pool**: the trajectory server's own ``TrajectoryBook`` (``trajectory_pool``);
  streaming systems keep ``(eta + 1) x capacity`` groups sampled and not yet trained; batch
  systems release one batch of ``B`` groups at a time (see ``systems``).
* **Staleness**: the real ``Ledger``. A group is reserved when its first member is checked out (at
  the V_traj the routing strategy chose), occupied when ``G`` members are rewarded (group
  redundancy: the first ``G``; the rest are aborted), consumed by the trainer; surplus groups it
  cancels (batch redundancy) are aborted on the instances.
* **Coordinator**: every ``cycle_period_s`` of virtual time, the real ``plan_cycle`` over the
  snapshots of the instances with no command in flight, the waiting trajectories, the ledger's
  admission table and the newest version. A cycle is skipped when nothing happened since the last
  one (and ``recheck_period_s`` has not passed) or when its plan is provably empty (nothing waits,
  no sync is due, no migration triggers). The plan becomes commands as in the coordinator
  (``staleflow.commands``); they land after ``CommandCosts`` latencies, a Route after the
  Interrupts whose partials it carries; a Pull is ``SimCore.load_weights`` (a kept Pull,
  ``Commands.kept``, keeps the instance's trajectories: nothing is handed back or re-prefilled).
* **Trainer**: as soon as the head staleness buffer is Ready and the trainer is idle it consumes
  the batch, trains for ``TrainerModel.step_seconds`` and the new version reaches the parameter
  server ``push_s`` later. Rollout and training overlap (colocated systems: eta = 0 makes them
  alternate).

Interrupting uses ``SimCore.abort`` and re-routing sends a request that carries the token *count*
(``CountedRequest``): the engine's timing is identical to an Interrupt but no token streams are
built, which keeps paper-scale memory and time small.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, replace

from staleflow.commands import commands_of
from staleflow.config.manager import LedgerParams
from staleflow.config.strategy import StrategyConfig, SyncMode
from staleflow.engines.base import SamplingParams, TrajectoryRequest
from staleflow.engines.sim import SimCore, SimFinished
from staleflow.ledger import Ledger, LedgerError
from staleflow.length_skew import LengthSkew, TrajectoryFate
from staleflow.simulation.completion_order import CompletionOrderLedger
from staleflow.simulation.length_views import PredictedLengths
from staleflow.simulation.result import Breakdown, DecisionStats, RunResult, SimStepRecord, Timeline
from staleflow.simulation.settings import SimulatedCluster
from staleflow.simulation.systems import CHECKPOINT_STALL_S, Pipeline, WeightSync
from staleflow.simulation.trajectory_pool import SimTrajectory, TrajectoryPool
from staleflow.simulation.transfer import TransferSchedule
from staleflow.strategies import (
    AdmissionBudget,
    CyclePlan,
    DecodeSpeeds,
    InstanceState,
    KvReadings,
    plan_cycle,
    plan_migrations,
)
from staleflow.trajectory_book import GroupRecord, TrajState
from staleflow.workload import stable_normal


class SimulationStalled(RuntimeError):
    """The job cannot make progress (nothing runs, trains or can be routed)."""


@dataclass(frozen=True, kw_only=True)
class CountedRequest(TrajectoryRequest):
    """A request that resumes a trajectory from a token count instead of its tokens."""

    generated: int = 0

    @property
    def num_generated(self) -> int:
        return self.generated

    @property
    def context_length(self) -> int:
        return len(self.prompt_ids) + self.generated

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - self.generated


# event kinds, in the order they are handled at equal times
_CORE, _LAND, _TRAIN_END, _PUBLISH, _TRAINER_FREE, _CYCLE = range(6)


def straggler_slowdowns(instances: int, sigma: float, seed: int) -> list[float]:
    """Persistent per-instance latency factors: instance ``i`` runs at speed ``exp(sigma z_i -
    sigma^2 / 2)`` (log-normal, mean 1, ``z_i`` a seeded standard normal), i.e. its every step and
    prefill take ``1 / speed`` times the cost model's time. ``sigma = 0``: identical instances."""
    if sigma < 0:
        raise ValueError("straggler sigma must be >= 0")
    return [math.exp(sigma * sigma / 2 - sigma * stable_normal("straggler", seed, i)) for i in range(instances)]


class _InstanceTime:
    __slots__ = ("route_s", "interrupt_s")

    def __init__(self) -> None:
        self.route_s = 0.0
        self.interrupt_s = 0.0


class ClusterSimulation:
    """``ClusterSimulation(config).run(steps)`` -> ``RunResult``. One instance runs once."""

    def __init__(self, config: SimulatedCluster):
        self.config = config
        self.system = config.system
        self.eta = config.effective_eta
        w = config.workload
        self.workload = w
        ledger_params = LedgerParams(self.eta, w.batch_size, self.system.batch_redundancy, w.group_size,
                                     self.system.group_redundancy)
        self.completion_order = self.system.completion_order
        self.ledger: Ledger | CompletionOrderLedger = (
            CompletionOrderLedger(ledger_params, self.system.bounded) if self.completion_order else Ledger(ledger_params))
        params = self.ledger.params
        self.pool = TrajectoryPool(w, w.batch_size, params.group_members, params.group_size,
                                   TrajectoryFate.DROPPED if self.system.batch_redundancy else TrajectoryFate.ABORTED)
        self.strategy: StrategyConfig = self.system.strategy_for(self.eta, w.batch_size, params.group_members)
        predicts = self.strategy.length_aware or self.strategy.adaptive_redundancy
        self.lengths = PredictedLengths(self.pool, w.max_response_tokens) if predicts else None
        sim = replace(config.sim, workload=w, reprefill=self.system.reprefill)
        if self.system.max_num_seqs is not None:
            sim = replace(sim, max_running=self.system.max_num_seqs)
        self.nccl = self.system.weight_sync is WeightSync.NCCL_BROADCAST and not self.system.colocated
        if self.nccl:  # every instance waits for the trainer's broadcast instead of a Pull
            sim = replace(sim, pull_latency_s=config.nccl_broadcast_s, model_bytes=0)
        room = sim.cost.kv_budget / sim.cost.k5
        if w.max_prompt_tokens + w.max_response_tokens > room:
            raise ValueError(f"a trajectory of up to {w.max_prompt_tokens} prompt + {w.max_response_tokens} response "
                             f"tokens cannot fit an instance's KV budget of {room:g} tokens")
        slowdowns = straggler_slowdowns(config.rollout_instances, config.straggler_sigma, sim.seed)
        self.nominal_cost = sim.cost  # what the coordinator's cost model says (it does not know the speeds)
        self._speeds = DecodeSpeeds()  # what the snapshots show of them
        self._kv_readings = KvReadings()  # repack: each instance's KV utilisation at the last check
        self._repack_due = 0.0 if self.strategy.migration.repacks else math.inf
        if self.system.checkpoint_tokens:  # each round's stall, spread over the steps between rounds
            per_step = CHECKPOINT_STALL_S / self.system.checkpoint_tokens
            sim = replace(sim, cost=replace(sim.cost, k4=sim.cost.k4 + per_step))
        self.cores = [SimCore(replace(sim, slowdown=f), f"inst-{i}") for i, f in enumerate(slowdowns)]
        transfer = config.transfer if self.system.weight_source is None else replace(config.transfer,
                                                                                     source=self.system.weight_source)
        # Pulls that share a source: each one's time depends on the others (else the engine's own holds)
        self.transfers = TransferSchedule(transfer) if transfer.contends and self.system.pulls_from_a_server else None
        self._index = {core.instance_id: i for i, core in enumerate(self.cores)}
        self.sampling = SamplingParams(max_tokens=w.max_response_tokens)
        self.colocated = self.system.colocated
        self.now = 0.0
        self.ps_version = 0
        self._batch_version = 0  # batch pipelines: the version the current batch is generated with
        self._batches = 0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._core_due: list[float | None] = [None] * len(self.cores)
        self._landing = [0] * len(self.cores)  # commands in flight per instance
        self._times = [_InstanceTime() for _ in self.cores]
        self._on_instances: dict = {}
        self._cycle_due: float | None = None
        self._busy_until: dict[int, float] = {}  # this cycle: when an instance's Interrupt/Pull lands
        self._last_cycle = -math.inf
        self._last_plan = -math.inf
        self._dirty = True
        self._idle_plans = 0
        self._cycles = 0
        self._skipped = 0
        self._decision_ms: list[float] = []
        self._training = False
        self._train_s = 0.0
        self._steps_target = 0
        self._steps_started = 0
        self._steps_done = 0
        self._steps: list[SimStepRecord] = []
        self._staleness: dict[int, dict[int, int]] = {}
        self._violations = 0
        self._exceedances = 0
        self._max_exceedance = 0
        self._counters: Counter[str] = Counter()
        self.skew = LengthSkew()  # what the bound did to the response lengths
        self.pool.skew = self.skew
        self._timeline = Timeline([c.instance_id for c in self.cores]) if config.record_timeline else None
        self._last_sample = -math.inf
        self._ran = False

    # ------------------------------------------------------------------ the run

    def run(self, steps: int) -> RunResult:
        """Simulate until ``steps`` training steps have finished."""
        if self._ran:
            raise RuntimeError("a ClusterSimulation runs once; make a new one")
        if steps < 1:
            raise ValueError("steps must be >= 1")
        self._ran = True
        started = time.perf_counter()
        self._steps_target = steps
        self._refill()
        self._request_cycle(0.0)
        while self._steps_done < steps:
            if not self._events:
                raise SimulationStalled(self._stall_message())
            t, kind, _, payload = heapq.heappop(self._events)
            self.now = t
            if kind == _CORE:
                self._on_core_event(payload, t)  # type: ignore[arg-type]
            elif kind == _LAND:
                self._on_land(*payload)  # type: ignore[misc]
            elif kind == _TRAIN_END:
                self._on_train_end(payload)  # type: ignore[arg-type]
            elif kind == _PUBLISH:
                self._on_publish(payload)  # type: ignore[arg-type]
            elif kind == _TRAINER_FREE:
                self._training = False
                self._try_train()
            else:
                self._on_cycle(t)
        return self._result(time.perf_counter() - started)

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def _schedule_core(self, i: int) -> None:
        t = self.cores[i].next_event_time()
        self._core_due[i] = t
        if t is not None:
            self._push(t, _CORE, i)

    def _on_core_event(self, i: int, t: float) -> None:
        if self._core_due[i] != t:
            return  # superseded by a command that changed the instance
        self._advance(i, t)
        self._schedule_core(i)
        self._mark_dirty()

    def _advance(self, i: int, t: float) -> None:
        """Run instance ``i`` to ``t`` and handle what finished."""
        core = self.cores[i]
        if t > core.now:
            core.advance_to(t)
        for finished in core.pop_finished():
            self._on_finished(i, finished)

    def _mark_dirty(self) -> None:
        self._dirty = True
        self._request_cycle(self.now)

    def _request_cycle(self, t: float) -> None:
        period = self.config.cycle_period_s
        tick = math.ceil(t / period - 1e-9) * period
        if tick <= self._last_cycle:
            tick = self._last_cycle + period
        if self._cycle_due is None or tick < self._cycle_due:
            self._cycle_due = tick
            self._push(tick, _CYCLE)

    # ------------------------------------------------------------------ trajectory pool

    def _refill(self) -> None:
        if self.system.pipeline is Pipeline.STREAM:
            missing = (self.eta + 1) * self.ledger.capacity - self.pool.live_groups()
            if missing > 0:
                self.skew.sampled((g.group_id for g in self.pool.sample(missing)), self.now)
                self._mark_dirty()
            return
        # batch pipelines: batch k starts once batch k-1 is generated and version k - eta exists
        if self._batches >= self._steps_target:
            return
        if self.pool.unfinished_groups():
            return
        if self.ps_version < self._batches - self.eta:
            return
        self._batch_version = self.ps_version
        self._batches += 1
        self.skew.sampled((g.group_id for g in self.pool.sample(self.workload.batch_size)), self.now)
        self._mark_dirty()

    def _visible_version(self) -> int:
        return self.ps_version if self.system.pipeline is Pipeline.STREAM else self._batch_version

    # ------------------------------------------------------------------ completions and aborts

    def _on_finished(self, i: int, finished: SimFinished) -> None:
        traj = self.pool.trajs.get(finished.traj_id)
        if traj is None or traj.engine != i:
            return
        traj.generated = finished.num_tokens
        self.skew.generated(traj.traj_id, traj.generated)
        self._on_instances.pop(traj.traj_id, None)
        self._counters["completed"] += 1
        if self.lengths is not None:
            self.lengths.finished(traj)
        surplus = self.pool.surplus_groups
        counted, occupied, abort = self.pool.completed(self.cores[i].instance_id, traj, self.ledger.occupy)
        if not counted:
            self._counters["wasted_tokens"] += traj.generated  # a surplus member finishing late
            self.skew.settle(traj.traj_id, TrajectoryFate.DROPPED)
            return
        self._settle(abort, surplus)
        if occupied:
            self._try_train()

    def _abort(self, trajs: list[SimTrajectory]) -> None:
        """Abort commands: cancelled trajectories leave their instances (one whose Route has not
        landed yet is acknowledged at once: the Route skips it)."""
        by_instance: dict[int, list[SimTrajectory]] = {}
        acknowledged = []
        for traj in trajs:
            if traj.engine is None:
                self.skew.stopped(traj.traj_id, traj.generated, traj.cut or TrajectoryFate.ABORTED)  # its Route was in flight
                acknowledged.append(traj)
            else:
                by_instance.setdefault(traj.engine, []).append(traj)
        self.pool.cancelled(acknowledged)
        for i, on_core in by_instance.items():
            self._advance(i, self.now)
            ids = [t.traj_id for t in on_core if t.engine == i and t.state is TrajState.CANCELLING]
            if not ids:
                continue
            self.cores[i].abort(ids)
            aborted = []
            for finished in self.cores[i].pop_finished():
                traj = self.pool.trajs.get(finished.traj_id)
                if traj is not None:
                    aborted.append(traj)
                    self.skew.stopped(traj.traj_id, finished.num_tokens, traj.cut or TrajectoryFate.ABORTED)
                    self._on_instances.pop(traj.traj_id, None)
                    self._counters["wasted_tokens"] += finished.num_tokens
            self.pool.cancelled(aborted)
            self._counters["aborted"] += len(ids)
            self._times[i].interrupt_s += self.config.commands.interrupt(len(ids))
            self._schedule_core(i)

    def _settle(self, abort: list[SimTrajectory], surplus_before: int) -> None:
        """After a call that followed ledger transitions: abort what they cancelled on the
        instances, and refill the pool if they cancelled groups."""
        if abort:
            self._abort(abort)
        if self.pool.surplus_groups != surplus_before:
            self._refill()
            self._try_train()

    # ------------------------------------------------------------------ trainer

    def _try_train(self) -> None:
        if self._training or self._steps_started >= self._steps_target or self.pool.occupied < self.workload.batch_size:
            return  # a Ready buffer needs B occupied groups
        surplus = self.pool.surplus_groups
        try:
            transition, batch, abort = self.pool.consume(self.ledger.consume)
        except LedgerError:
            return
        buffer = transition.buffer
        assert buffer is not None and transition.consumed is not None
        record = self._record_batch(buffer, len(transition.consumed), batch)
        if self.lengths is not None:
            self.lengths.forget(transition.consumed)
        seconds = self.config.trainer.step_seconds(record.trained_tokens, self.config.train_gpus)
        self._training = True
        self._steps_started += 1
        if self.colocated:
            self._train_s += seconds
        self._steps.append(record)  # end_s is set when training ends
        self._push(self.now + seconds, _TRAIN_END, buffer)
        self._settle(abort, surplus)
        self._refill()
        self._mark_dirty()

    def _record_batch(self, buffer: int, groups: int, batch: list[tuple[SimTrajectory, GroupRecord]]) -> SimStepRecord:
        lengths: list[int] = []
        trained = 0
        hist: Counter[int] = Counter()
        for traj, group in batch:
            assert group.v_traj is not None
            staleness = buffer - group.v_traj
            hist[staleness] += 1
            oldest = traj.oldest_version
            if not self.system.keeps_bound and staleness > self.eta:  # the system's own rule allows it
                self._exceedances += 1
                self._max_exceedance = max(self._max_exceedance, staleness - self.eta)
            elif not 0 <= staleness <= self.eta or oldest is None or oldest < group.v_traj:
                self._violations += 1
            lengths.append(traj.generated)
            trained += traj.context
        self._staleness[buffer] = dict(sorted(hist.items()))
        self.skew.consumed(buffer, [(t.traj_id, buffer - g.v_traj) for t, g in batch])  # type: ignore[operator]
        return SimStepRecord(
            step=len(self._steps) + 1, buffer=buffer, start_s=self.now, end_s=math.nan, groups=groups,
            trajectories=len(lengths), response_tokens=sum(lengths), trained_tokens=trained,
            mean_response=sum(lengths) / len(lengths) if lengths else 0.0, max_response=max(lengths, default=0),
            staleness=dict(sorted(hist.items())),
        )

    def _on_train_end(self, buffer: int) -> None:
        self._steps_done += 1
        next(r for r in self._steps if r.buffer == buffer).end_s = self.now
        if self.nccl:  # the broadcast starts now and holds the trainer until it is over
            self._push(self.now, _PUBLISH, buffer + 1)
            self._push(self.now + self.config.nccl_broadcast_s, _TRAINER_FREE)
            return
        self._training = False
        push = 0.0 if self.colocated or self.system.weight_sync is WeightSync.NONE else self.config.trainer.push_s
        self._push(self.now + push, _PUBLISH, buffer + 1)
        self._try_train()

    def _on_publish(self, version: int) -> None:
        self.ps_version = max(self.ps_version, version)
        self._repack_due = min(self._repack_due, self.now)  # a repack check follows every new version
        self._refill()
        self._mark_dirty()

    # ------------------------------------------------------------------ the coordinator cycle

    def _on_cycle(self, t: float) -> None:
        if self._cycle_due != t:
            return
        self._cycle_due = None
        self._last_cycle = t
        self._cycles += 1
        if self._timeline is not None and t - self._last_sample >= self.config.timeline_period_s:
            self._sample_timeline(t)
        if not self._dirty and t - self._last_plan < self.config.recheck_period_s:
            self._skipped += 1
            self._request_cycle(self._last_plan + self.config.recheck_period_s)
            return
        self._dirty = False
        self._last_plan = t
        plan = self._plan(t)
        if plan is not None and not plan.empty:
            self._issue(plan, t)
            self._idle_plans = 0
        elif not (self._training or self._events_pending()):
            self._idle_plans += 1
            if self._idle_plans >= 3:
                raise SimulationStalled(self._stall_message())
        if self._work_in_flight():
            self._request_cycle(t + self.config.recheck_period_s)

    def _plan(self, t: float) -> CyclePlan | None:
        self._busy_until = {}
        ready = [i for i in range(len(self.cores)) if not self._landing[i]]
        states = []
        for i in ready:
            self._advance(i, t)
            snap = self.cores[i].snapshot()
            if snap.loading_weights:
                continue
            speed = self._speeds.observe(self.cores[i].instance_id, snap.decode_steps, snap.decode_seconds,
                                         snap.kv_cache, len(snap.run_trajs), self.nominal_cost)
            states.append(InstanceState(self.cores[i].instance_id, snap.inst_version, float(snap.kv_cache),
                                        list(snap.run_trajs), list(snap.wait_trajs), self.nominal_cost, speed,
                                        snap.kv_usage))
        version = self._visible_version()
        if self.strategy.sync is SyncMode.GLOBAL and len(states) < len(self.cores):
            states = [s for s in states if s.version >= version]  # a global sync waits for everyone
        if not states:
            self._skipped += 1
            return None
        if self.system.resume_in_place:
            states = self._sync_in_place(states, version, t)
        pending = self.pool.pending()
        admission = self.ledger.admission()
        if self.system.new_work_on_newest:  # new groups start only on the newest weights
            admission = {v: n for v, n in admission.items() if v >= version}
        repack_previous = None
        if t >= self._repack_due:  # a repack check: against the readings of the last one
            repack_previous = self._kv_readings.previous()
            self._kv_readings.record(states)
            self._repack_due = t + self.strategy.repack_period_s
        elif not self._may_act(states, pending, version, admission):
            self._skipped += 1
            return None
        started = time.perf_counter()  # predicting lengths is part of the coordinator's decision
        if self.lengths is not None:
            if self.strategy.length_aware:
                pending = self.lengths.with_remainders(pending)
            if self.strategy.adaptive_redundancy:
                admission = self.lengths.spare_admission(admission, self.strategy, self.eta,
                                                         self.ledger.capacity - self.workload.batch_size)
        plan = plan_cycle(states, pending, version, admission, self.strategy, self._on_instances,
                          repack_previous=repack_previous)
        self._decision_ms.append((time.perf_counter() - started) * 1e3)
        return plan

    def _sync_in_place(self, states: list[InstanceState], version: int, t: float) -> list[InstanceState]:
        """A global sync that resumes every instance's own trajectories on it after the Pull
        (VeRL-Async / AReaL: pause, load weights, recompute KV, continue; no migration). The
        strategies then see the instances at the new version with the same trajectories."""
        out = []
        for s in states:
            if s.version >= version:
                out.append(s)
                continue
            i = self._index[s.instance_id]
            ids = s.trajectories
            latency = self.config.commands.interrupt(len(ids))
            self._times[i].interrupt_s += latency
            self._counters["syncs"] += 1
            self._busy_until[i] = t + latency
            self._land(t + latency, i, "resume", ids, True)
            out.append(InstanceState(s.instance_id, version, 0.0, [], ids, s.cost))
        return out

    def _may_act(self, states: list[InstanceState], pending: list, version: int, admission: dict[int, int]) -> bool:
        """False only when plan_cycle would certainly return an empty plan."""
        lagging = self.strategy.sync is not SyncMode.NEVER and any(s.version < version for s in states)
        if lagging and self.strategy.sync is not SyncMode.SELECTIVE:
            return True
        if plan_migrations(states, self.strategy, pending, AdmissionBudget(admission)):
            return True
        if not pending:
            return False  # selective sync needs something to route on the new version
        if self.pool.book.versioned_pending():
            return True
        versions = {s.version for s in states}
        if lagging:
            versions.add(version)
        return any(admission.get(v, 0) > 0 for v in versions)

    def _issue(self, plan: CyclePlan, t: float) -> None:
        costs = self.config.commands
        commands = commands_of(plan)
        back_at: dict[str, float] = {}  # interrupted trajectory -> when its partial is in the TS
        kept = commands.kept
        syncs = set(commands.pulls) - kept
        repacked = {m.source for m in plan.repacks}  # Pulls that interrupt everything on their instance
        self._counters["syncs"] += len(commands.pulls)
        self._counters["repacks"] += len(plan.repacks)
        self._counters["repacked"] += sum(len(m.trajectories) for m in plan.repacks)
        for instance_id, traj_ids in commands.interrupts.items():
            i = self._index[instance_id]
            latency = costs.interrupt(len(traj_ids))
            self._times[i].interrupt_s += latency
            if instance_id not in syncs and instance_id not in repacked:
                self._counters["migrated"] += len(traj_ids)
            for traj_id in traj_ids:
                back_at[traj_id] = t + latency
            self._busy_until[i] = t + latency
            self._land(t + latency, i, "interrupt", traj_ids, instance_id in syncs)
        for instance_id in commands.pulls:  # list order: reproducible event order in every process
            i = self._index[instance_id]
            if instance_id in kept:  # after a migration's Interrupt, if any; Routes to it land after it
                self._busy_until[i] = self._busy_until.get(i, t)
                self._land(self._busy_until[i], i, "keep", [], True)
            elif instance_id not in commands.interrupts:
                self._land(t, i, "interrupt", [], True)
        for instance_id, assignments in commands.routes.items():
            j = self._index[instance_id]
            now, after_interrupt = [], []
            for traj_id, v_traj in assignments:
                traj = self.pool.trajs.get(traj_id)
                if traj is not None and traj.engine is not None and traj_id in back_at:
                    if traj.group.v_traj == v_traj:  # checked out once its partial is back
                        traj.route_to = j
                        after_interrupt.append(traj_id)
                else:
                    now.append((traj_id, v_traj))
            surplus = self.pool.surplus_groups
            routed, refused, abort = self.pool.checkout(instance_id, now, self.ledger.reserve)
            for group_id in self.pool.reserved:
                self.skew.admitted(group_id, t)
            self._counters["refused_reservations"] += refused
            self._settle(abort, surplus)
            going = {x.traj_id for x in routed}.union(after_interrupt)
            traj_ids = [traj_id for traj_id, _ in assignments if traj_id in going]  # the engine queues them in order
            if not traj_ids:
                continue
            # after the partials it carries are back, and after this instance's own Interrupt / Pull
            start = max([t, self._busy_until.get(j, t), *(back_at.get(x, t) for x in traj_ids)])
            latency = costs.route(len(traj_ids))
            self._times[j].route_s += latency
            self._land(start + latency, j, "route", traj_ids, False)

    def _land(self, t: float, i: int, kind: str, traj_ids: list[str], pull: bool) -> None:
        self._landing[i] += 1
        version = self._visible_version() if pull else None
        self._push(t, _LAND, (i, kind, traj_ids, version))

    def _on_land(self, i: int, kind: str, traj_ids: list[str], version: int | None) -> None:
        self._landing[i] -= 1
        self._advance(i, self.now)
        core = self.cores[i]
        if kind in ("interrupt", "resume"):
            ids = [x for x in traj_ids if (tr := self.pool.trajs.get(x)) and tr.engine == i]
            if version is not None:  # a Pull hands back everything on the instance
                snap = core.snapshot()
                listed = set(ids)
                ids += [x for x in (*snap.run_trajs, *snap.wait_trajs) if x not in listed]
            if kind == "resume":  # they come straight back after the Pull
                for x in ids:
                    self.pool.trajs[x].route_to = i
            self._take_back(i, ids)
            if version is not None and version >= core.version:
                core.load_weights(version, seconds=self._pull_seconds(core, version))
                if self._timeline is not None:
                    self._timeline.syncs.append((self.now, i, version))
            if kind == "resume":
                self._route_now(i, ids)
        elif kind == "keep":
            if version is not None and version >= core.version:
                core.load_weights(version, keep_running=True, seconds=self._pull_seconds(core, version))
                if self._timeline is not None:
                    self._timeline.syncs.append((self.now, i, version))
        else:
            self._route_now(i, traj_ids)
        self._schedule_core(i)
        self._mark_dirty()

    def _pull_seconds(self, core: SimCore, version: int) -> float | None:
        """How long this Pull takes given the others of the job (None: the engine's own time)."""
        if self.transfers is None:
            return None
        params = core.params
        return params.pull_latency_s + self.transfers.pull(core.instance_id, version, self.now, params.model_bytes,
                                                           params.pull_bandwidth_bytes_per_s)

    def _route_now(self, i: int, traj_ids: list[str]) -> None:
        """The trajectories checked out to instance ``i`` among ``traj_ids`` reach its engine."""
        core = self.cores[i]
        requests = []
        for traj_id in traj_ids:
            traj = self.pool.trajs.get(traj_id)
            if (traj is None or traj.state is not TrajState.ROUTED or traj.record.instance_id != core.instance_id
                    or traj.engine is not None):
                continue
            group = traj.group
            assert group.v_traj is not None
            requests.append(CountedRequest(traj_id=traj_id, group_id=group.group_id, prompt_ids=group.prompt_ids,
                                           v_traj=group.v_traj, sampling=self.sampling, generated=traj.generated))
            traj.engine = i
            traj.oldest_version = core.version if traj.oldest_version is None else min(traj.oldest_version, core.version)
            self._on_instances[traj_id] = traj.view
        if requests:
            core.route(requests)
            self._counters["routed"] += len(requests)

    def _take_back(self, i: int, traj_ids: list[str]) -> None:
        """Interrupt: the trajectories leave the instance with what they generated so far and go
        back to the trajectory server; those the plan routed elsewhere are checked out there."""
        if not traj_ids:
            return
        core = self.cores[i]
        core.abort(traj_ids)
        back = []
        for finished in core.pop_finished():
            traj = self.pool.trajs.get(finished.traj_id)
            if traj is None:
                continue
            traj.generated = finished.num_tokens
            self._on_instances.pop(traj.traj_id, None)
            self._counters["interrupted"] += 1
            back.append(traj)
        self.pool.returned(core.instance_id, back)
        onward: dict[int, list[tuple[str, int]]] = {}
        for traj in back:
            if traj.route_to is not None and traj.group.v_traj is not None:
                onward.setdefault(traj.route_to, []).append((traj.traj_id, traj.group.v_traj))
            traj.route_to = None
        for j, assignments in onward.items():
            surplus = self.pool.surplus_groups
            _, _, abort = self.pool.checkout(self.cores[j].instance_id, assignments, self.ledger.reserve)
            self._settle(abort, surplus)

    # ------------------------------------------------------------------ bookkeeping

    def _events_pending(self) -> bool:
        return any(t is not None for t in self._core_due) or any(self._landing)

    def _work_in_flight(self) -> bool:
        return self.pool.pending_count > 0 or any(core.busy for core in self.cores) or any(self._landing)

    def _sample_timeline(self, t: float) -> None:
        assert self._timeline is not None
        self._last_sample = t
        running, waiting = [], []
        for i, core in enumerate(self.cores):
            self._advance(i, t)
            snap = core.snapshot()
            running.append(len(snap.run_trajs))
            waiting.append(len(snap.wait_trajs))
        self._timeline.times.append(t)
        self._timeline.running.append(running)
        self._timeline.waiting.append(waiting)

    def _stall_message(self) -> str:
        buffers = ", ".join(f"{b.version}:{b.state.value}({b.occupied}/{len(b.entries)})" for b in self.ledger.buffers())
        return (f"{self.system.name} (eta={self.eta}) stalled at t={self.now:.1f}s after {len(self._steps)} steps: "
                f"ps_version={self.ps_version}, instance versions={sorted({c.version for c in self.cores})}, "
                f"pending={self.pool.pending_count}, buffers=[{buffers}], admission={self.ledger.admission()}")

    def _result(self, wall_s: float) -> RunResult:
        end = self._steps[-1].end_s
        for i in range(len(self.cores)):
            self._advance(i, max(end, self.cores[i].now))
        steps = len(self._steps)
        n = len(self.cores)
        per = 1.0 / (steps * n)
        stats = [c.stats for c in self.cores]
        breakdown = Breakdown(
            decode_s=sum(s.decode_seconds for s in stats) * per,
            prefill_s=sum(s.prefill_seconds for s in stats) * per,
            pull_s=sum(s.pull_seconds for s in stats) * per,
            route_s=sum(x.route_s for x in self._times) * per,
            interrupt_s=sum(x.interrupt_s for x in self._times) * per,
            train_s=self._train_s / steps,
        )
        busy = breakdown.decode_s + breakdown.prefill_s + breakdown.pull_s + breakdown.train_s
        breakdown.idle_s = max(0.0, end / steps - busy)
        tokens = sum(r.response_tokens for r in self._steps)
        trajectories = sum(r.trajectories for r in self._steps)
        counters = dict(self._counters)
        counters["preemptions"] = sum(s.preemptions for s in stats)
        counters["pulls"] = sum(s.pulls for s in stats)
        counters["prefill_tokens"] = sum(s.prefill_tokens for s in stats)
        counters["generated_tokens"] = sum(s.tokens_generated for s in stats)
        counters["surplus_groups"] = self.pool.surplus_groups
        counters["wasted_tokens"] = counters.get("wasted_tokens", 0) + self.pool.wasted_tokens
        for key in ("completed", "routed", "interrupted", "migrated", "repacks", "repacked", "syncs", "aborted",
                    "surplus_groups", "wasted_tokens", "refused_reservations"):
            counters.setdefault(key, 0)
        return RunResult(
            system=self.system.name, label=self.system.label, family=self.system.family.value, eta=self.eta,
            instances=n, train_gpus=self.config.train_gpus, steps=steps, total_time_s=end,
            response_tokens=tokens, throughput=tokens / end if end > 0 else 0.0,
            mean_response=tokens / trajectories if trajectories else 0.0,
            max_response=max((r.max_response for r in self._steps), default=0),
            step_records=self._steps, breakdown=breakdown, staleness=self._staleness, violations=self._violations,
            exceedances=self._exceedances, max_exceedance=self._max_exceedance,
            decisions=DecisionStats.of(self._cycles, self._skipped, self._decision_ms),
            counters=dict(sorted(counters.items())), wall_s=wall_s, timeline=self._timeline,
            length_skew=self.skew.to_json(),
            busy_kv_utilisation=_busy_kv_utilisation(self.cores),
        )


def _busy_kv_utilisation(cores: list[SimCore]) -> float:
    """The KV cache held while generating, as a share of the budget: the time-weighted mean over
    every instance's seconds of decode and prefill (Laminar's Table 1 "average KV cache util.")."""
    busy = sum(c.stats.decode_seconds + c.stats.prefill_seconds for c in cores)
    held = sum(c.stats.kv_seconds / c.cost.kv_budget for c in cores)
    return held / busy if busy > 0 else 0.0


def simulate(config: SimulatedCluster, steps: int) -> RunResult:
    """One run: ``ClusterSimulation(config).run(steps)``."""
    return ClusterSimulation(config).run(steps)
