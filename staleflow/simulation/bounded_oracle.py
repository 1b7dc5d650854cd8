"""``oracle-eta schedule``: a clairvoyant schedule that respects the staleness bound exactly.

The ``oracle`` system has no bound at all, so the gap to it mixes what the bound costs with what
coordination loses. This module schedules a job that knows every response length in advance,
under the same bound, on instances whose pace follows their load as the simulated engine's does.
It is a feasible schedule, a lower estimate of the best one; ``schedule_bound`` (``oracle-eta``)
bounds the best one from above, and ``exact`` finds it on tiny jobs.

The model (pure, no I/O):

* instance ``i`` runs a continuous batch: one decode step generates a token for each of its
  ``n`` running trajectories and takes ``slowdown[i] * (L(kv, n) + prefill)`` seconds, ``L`` the
  cost model's step latency (Eq. 11) at the KV its running trajectories hold (prompt and response
  so far, ``k5`` units a token) and ``prefill`` that of the trajectories that run for the first
  time (their prompt, once); a straggler's ``slowdown`` is above 1;
* at a step boundary an instance may start trajectories (they stay on it) and choose which of its
  trajectories run, at most ``max_running``, as long as their KV after the step fits its budget;
  one that does not run holds no KV and resumes where it was for free, as in the unbounded
  ``oracle``'s engine (nothing is prefilled twice); an idle instance starts at time 0, when a
  version is published, or at the end of its own step;
* weights change for free and keep the KV: nothing is synced or interrupted;
* step ``k`` (1-based) trains the ``k``-th batch of ``B`` groups in sampling order, as the strict
  bounded systems do (a clairvoyant scheduler could also choose which groups a step trains:
  another job); it starts once its groups are complete and step ``k - 1`` has ended, takes the
  trainer's time for its tokens, and publishes version ``k`` ``push_s`` after it ends;
* the bound: every trajectory trained by step ``k`` (V_buf = k - 1) starts at a version
  ``>= k - 1 - eta``, i.e. not before version ``k - 1 - eta`` is published. Its later tokens may
  come from newer weights (the update keeps its KV), so V_traj is its start version and
  ``V_buf - V_traj <= eta`` holds.

Throughput is the trained response tokens over the time the last step ends, as for every system.

``exact`` searches every schedule of the model, step by step: at every boundary of every
instance it tries every set of startable trajectories to start and every set of its own to run,
remembering the states it has searched and cutting branches that cannot beat the best found. Its
cost grows exponentially: tiny cases only.

``heuristic`` runs at scale, from boundary to boundary that matters. ``Router`` assigns each
trajectory to an instance when its step may start, oldest step and longest first, onto the
instance whose outstanding work would end first at its speed (LPT list scheduling on machines of
different speeds); an instance
pauses its lowest-priority trajectories when the next step would not fit its KV, and when one of
its trajectories ends, at time 0 or at its first boundary after a publication, it starts what it
was routed that may start and runs what it holds in priority order while it fits and it runs fewer
than a concurrency cap (head of line, as vLLM's waiting queue). It tries a few caps (the same on
every instance, or scaled by speed), under the bound and the next tighter one, and keeps the best.
``replay`` runs a policy through the step-by-step model: the tests check that the heuristic's
schedule is the greedy policy's there (so ``exact`` considers it) and measure the gap.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from staleflow.cost_model import CostModel
from staleflow.simulation.cluster import straggler_slowdowns
from staleflow.simulation.scenarios import Scenario
from staleflow.simulation.systems import ORACLE_SPEC


@dataclass(frozen=True)
class BoundedJob:
    """One job: every sampled group's response lengths in sampling order, and the cluster."""

    groups: tuple[tuple[int, ...], ...]  # response tokens per member, per group, in sampling order
    batch_size: int
    steps: int
    eta: int
    slowdowns: tuple[float, ...]  # one per rollout instance: its latency factor
    cost: CostModel
    max_running: int
    train_overhead_s: float
    train_s_per_token: float = 0.0
    push_s: float = 0.0
    prompt_tokens: tuple[int, ...] = ()  # per group (prefilled once, held in the KV, trained); () = none
    prefill_s_per_token: float = 0.0
    prefill_attention_s: float = 0.0  # per (query, key) pair of causal prefill attention
    moves: bool = False  # a started trajectory that does not run may move to another instance (re-prefilled there)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.steps < 1 or self.eta < 0 or not self.slowdowns or self.max_running < 1:
            raise ValueError("need batch_size >= 1, steps >= 1, eta >= 0, max_running >= 1 and an instance")
        if not self.train_overhead_s > 0 or self.train_s_per_token < 0 or self.push_s < 0:
            raise ValueError("need train_overhead_s > 0 (a step takes time), train_s_per_token >= 0 and push_s >= 0")
        if len(self.groups) < self.steps * self.batch_size:
            raise ValueError("not enough groups for the steps")
        if self.prompt_tokens and len(self.prompt_tokens) < len(self.groups):
            raise ValueError("need one prompt length per group")
        budget = self.cost.kv_budget / self.cost.k5
        for g in range(self.steps * self.batch_size):
            if any(n < 1 or self.prompt(g) + n > budget for n in self.groups[g]):
                raise ValueError(f"group {g}: every response needs 1 or more tokens and must fit the KV budget")

    def prompt(self, group: int) -> int:
        return self.prompt_tokens[group] if self.prompt_tokens else 0

    def train_seconds(self, step: int) -> float:
        batch = range((step - 1) * self.batch_size, step * self.batch_size)
        tokens = sum(sum(self.groups[g]) + len(self.groups[g]) * self.prompt(g) for g in batch)
        return self.train_overhead_s + self.train_s_per_token * tokens

    def prefill_seconds(self, context: int) -> float:
        return self.prefill_s_per_token * context + self.prefill_attention_s * context * context / 2

    def trajectories(self) -> list[OracleTrajectory]:
        """Every trained trajectory, in the heuristic's order: oldest step first, longest first."""
        return list(self._trajectories)

    @functools.cached_property
    def _trajectories(self) -> tuple[OracleTrajectory, ...]:
        out = sorted((k + 1, -length, self.prompt(g)) for k in range(self.steps)
                     for g in range(k * self.batch_size, (k + 1) * self.batch_size) for length in self.groups[g])
        return tuple(OracleTrajectory(step, -negative, prompt, i) for i, (step, negative, prompt) in enumerate(out))

    @property
    def tokens(self) -> int:
        return sum(sum(self.groups[g]) for g in range(self.steps * self.batch_size))


@dataclass(frozen=True, order=True)
class OracleTrajectory:
    step: int  # the training step that trains it
    length: int  # response tokens
    prompt: int
    index: int  # its place in BoundedJob.trajectories(): the heuristic's priority (lower first)

    @property
    def kind(self) -> tuple[int, int, int]:
        return self.step, self.length, self.prompt


@dataclass(frozen=True)
class BoundedSchedule:
    makespan_s: float
    tokens: int
    caps: tuple[int, ...] = ()  # the heuristic's: each instance's concurrency cap
    starts: tuple[float, ...] = ()  # the heuristic's: when each trajectory (by index) started
    published: tuple[float, ...] = ()  # the heuristic's: when each version was published (0: at 0)
    eta: int | None = None  # the heuristic's: the bound it scheduled under (the job's or tighter)
    moves: bool = False  # the heuristic's: whether its schedule moved trajectories between instances

    @property
    def throughput(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


class _Trainer:
    """Steps in order: each starts when its batch is complete and the previous step has ended."""

    def __init__(self, job: BoundedJob):
        self.job = job
        self.left = [0] * (job.steps + 1)
        for t in job.trajectories():
            self.left[t.step] += 1
        self.done_at = [0.0] * (job.steps + 1)
        self.published = [0.0] * (job.steps + 1)  # version v is published at published[v]
        self.known = 0  # steps whose end (and publication) is known
        self.end = 0.0

    def copy(self) -> _Trainer:
        other = object.__new__(_Trainer)
        other.job, other.known, other.end = self.job, self.known, self.end
        other.left, other.done_at, other.published = self.left[:], self.done_at[:], self.published[:]
        return other

    def complete(self, step: int, t: float) -> list[float]:
        """A trajectory of ``step`` ended at ``t``: the publication times this makes known."""
        self.left[step] -= 1
        self.done_at[step] = max(self.done_at[step], t)
        news = []
        while self.known < self.job.steps and self.left[self.known + 1] == 0:
            self.known += 1
            self.end = max(self.end, self.done_at[self.known]) + self.job.train_seconds(self.known)
            self.published[self.known] = self.end + self.job.push_s
            news.append(self.published[self.known])
        return news

    def release(self, step: int) -> float | None:
        """When trajectories of ``step`` may start (version step-1-eta published); None: not known yet."""
        version = step - 1 - self.job.eta
        if version <= 0:
            return 0.0
        return self.published[version] if version <= self.known else None

    @property
    def finished(self) -> bool:
        return self.known == self.job.steps


class Router:
    """The heuristic's routing: when a step's trajectories may start (time 0, or the publication
    of the version they need), each, oldest step and longest first, goes to the instance whose
    outstanding work (prompt and response tokens of what it was given and has not ended) would end
    first at its speed: LPT list scheduling on machines of different speeds."""

    def __init__(self, job: BoundedJob):
        self.job = job
        self.slowdowns = np.array(job.slowdowns)
        self.by_step: dict[int, list[OracleTrajectory]] = {}
        for x in job.trajectories():
            self.by_step.setdefault(x.step, []).append(x)
        self.routed = 0  # steps routed so far
        self.route: dict[int, int] = {}  # trajectory index: instance

    def route_through(self, step: int, outstanding: Sequence[float]) -> list[tuple[OracleTrajectory, int]]:
        """Route the steps up to ``step`` not routed yet, given each instance's outstanding work."""
        work, out = np.array(outstanding, dtype=float), []
        while self.routed < min(step, self.job.steps):
            self.routed += 1
            for x in self.by_step[self.routed]:
                k = int(np.argmin((work + (x.length + x.prompt)) * self.slowdowns))
                work[k] += x.length + x.prompt
                self.route[x.index] = k
                out.append((x, k))
        return out

    def first_steps(self) -> int:
        """The steps that may start at time 0."""
        return 1 + self.job.eta


# ---------------------------------------------------------------------- the model, step by step


class _Held:
    """A trajectory started on an instance; ``done``: its response tokens so far. When it does not
    run it holds no KV (resuming on the same instance is free: nothing is prefilled twice); moved
    to another instance it is prefilled there again, its prompt and what it generated."""

    __slots__ = ("traj", "done", "running", "prefilled")

    def __init__(self, traj: OracleTrajectory):
        self.traj, self.done, self.running, self.prefilled = traj, 0, False, False

    def copy(self) -> _Held:
        other = _Held(self.traj)
        other.done, other.running, other.prefilled = self.done, self.running, self.prefilled
        return other

    @property
    def context(self) -> int:
        return self.traj.prompt + self.done


class _Instance:
    __slots__ = ("held", "next_s", "prev_s")

    def __init__(self) -> None:
        self.held: list[_Held] = []  # started, not ended
        self.next_s: float | None = 0.0  # its next boundary (running) or wake (idle); None: none known
        self.prev_s = -math.inf  # its previous boundary or wake

    def copy(self) -> _Instance:
        other = _Instance()
        other.held, other.next_s, other.prev_s = [h.copy() for h in self.held], self.next_s, self.prev_s
        return other


# indexes of the trajectories to run, new ones to start, and those moved here from other instances
# (started there, not running: they run here at once, prefilled again)
Choice = tuple[frozenset[int], tuple[OracleTrajectory, ...], tuple[int, ...]]
Policy = Callable[["_StepModel", int, list[OracleTrajectory], bool], list[Choice]]


class _StepModel:
    """The model of the module docstring, one decode step at a time (tiny cases)."""

    def __init__(self, job: BoundedJob):
        self.job = job
        self.budget = job.cost.kv_budget / job.cost.k5
        self.trainer = _Trainer(job)
        self.pending = job.trajectories()  # not started, by index
        self.ended: dict[int, float] = {}  # trajectory index: when it ended
        self.now = 0.0
        self.instances = [_Instance() for _ in job.slowdowns]

    def copy(self) -> _StepModel:
        other = object.__new__(_StepModel)
        other.job, other.budget, other.trainer = self.job, self.budget, self.trainer.copy()
        other.pending, other.instances = self.pending[:], [i.copy() for i in self.instances]
        other.ended, other.now = dict(self.ended), self.now
        return other

    def key(self, k: int) -> tuple:
        """Everything the rest of the schedule depends on, at instance ``k``'s boundary (identical
        trajectories are interchangeable)."""
        instances = tuple((i.next_s, i.prev_s, tuple(sorted((h.traj.kind, h.done, h.running, h.prefilled)
                                                             for h in i.held))) for i in self.instances)
        t = self.trainer
        return (k, instances, tuple(x.kind for x in self.pending), t.known, t.end, tuple(t.left),
                tuple(t.done_at), tuple(t.published))

    def next_decision(self) -> tuple[float, int] | None:
        times = [(i.next_s, k) for k, i in enumerate(self.instances) if i.next_s is not None]
        return min(times) if times else None

    def boundary(self, k: int) -> tuple[float, list[OracleTrajectory], bool]:
        """Instance ``k`` reaches its next boundary: its step's tokens are generated and the
        trajectories that are complete end. Returns the time, what may start now, and whether this
        boundary is an event (one ended, a version was published since its previous boundary, or
        time 0)."""
        inst = self.instances[k]
        t = inst.next_s
        assert t is not None
        self.now, ended = t, False
        for h in [h for h in inst.held if h.running]:
            h.done += 1
            if h.done == h.traj.length:
                ended = True
                self.ended[h.traj.index] = t
                inst.held.remove(h)
                for p in self.trainer.complete(h.traj.step, t):
                    for other in self.instances:
                        if not other.held and other.next_s is None and p > other.prev_s:
                            other.next_s = p
        published = self.trainer.published[1:self.trainer.known + 1]
        event = ended or inst.prev_s == -math.inf or any(inst.prev_s < p <= t for p in published)
        startable = [x for x in self.pending if (r := self.trainer.release(x.step)) is not None and r <= t]
        return t, startable, event

    def start(self, k: int, t: float, choice: Choice) -> bool:
        """From instance ``k``'s boundary ``t``, start ``choice``'s new trajectories there and run
        its chosen ones for a step; False when that does not fit (KV or ``max_running``), runs
        what is not there, or (without moves) leaves an instance idle that holds trajectories."""
        inst, job = self.instances[k], self.job
        run, new, moved = choice
        for x in new:
            self.pending.remove(x)
            inst.held.append(_Held(x))
        for index in moved:
            source = next(i for i in self.instances if i is not inst and any(h.traj.index == index for h in i.held))
            h = next(h for h in source.held if h.traj.index == index)
            if h.running or index not in run:
                return False
            source.held.remove(h)
            h.prefilled = False
            inst.held.append(h)
        running = [h for h in inst.held if h.traj.index in run]
        for h in inst.held:
            h.running = h in running
        n, kv = len(running), sum(h.context for h in running)
        # holding trajectories without running any only helps when another instance may take them
        if n != len(run) or n > job.max_running or kv + n > self.budget or (inst.held and not running
                                                                            and not job.moves):
            return False
        inst.prev_s = t
        if running:
            prefill = sum(job.prefill_seconds(h.context) for h in running if not h.prefilled)
            for h in running:
                h.prefilled = True
            inst.next_s = t + job.slowdowns[k] * (job.cost.step_latency(job.cost.kv_units(kv), n) + prefill)
        else:  # idle: wake at the next known publication, if any
            later = [p for p in self.trainer.published[1:self.trainer.known + 1] if p > t]
            inst.next_s = min(later) if later else None
        return True


def replay(job: BoundedJob, policy: Policy) -> float:
    """The makespan of the schedule ``policy``'s first choices make (inf: it stalls)."""
    return _search(_StepModel(job), lambda m, k, s, e: policy(m, k, s, e)[:1], math.inf, None)


def _search(model: _StepModel, policy: Policy, best: float, seen: dict | None) -> float:
    """The shortest makespan below ``best`` over every choice ``policy`` offers, from ``model`` on
    (which it changes); inf when there is none. ``seen`` remembers the states already searched."""
    job, trainer = model.job, model.trainer
    while True:
        if trainer.finished:
            return trainer.end if trainer.end < best else math.inf
        nxt = model.next_decision()
        if nxt is None:
            return math.inf
        t, k = nxt
        training_left = sum(job.train_seconds(step) for step in range(trainer.known + 1, job.steps + 1))
        if max(t, trainer.end) + training_left >= best:
            return math.inf
        t, startable, event = model.boundary(k)
        options = policy(model, k, startable, event)
        if len(options) == 1:
            if not model.start(k, t, options[0]):
                return math.inf
            continue
        state = model.key(k)
        if seen is not None and state in seen:
            value, bound = seen[state]
            if value < math.inf or bound >= best:
                return value if value < best else math.inf
        found = math.inf
        for choice in options:
            branch = model.copy()
            if branch.start(k, t, choice):
                found = min(found, _search(branch, policy, min(best, found), seen))
        if seen is not None:
            seen[state] = (found, best)
        return found


def _every_choice(model: _StepModel, k: int, startable: list[OracleTrajectory], event: bool) -> list[Choice]:
    """Any trajectories that may start, and any of those the instance holds, run (starting one
    only to hold it does nothing that starting it later would not)."""
    held = [h.traj.index for h in model.instances[k].held]
    by_kind: dict[tuple[int, int, int], list[OracleTrajectory]] = {}
    for x in startable:
        by_kind.setdefault(x.kind, []).append(x)
    news: list[tuple[OracleTrajectory, ...]] = [()]
    for same in by_kind.values():
        news = [new + tuple(same[:count]) for new in news for count in range(len(same) + 1)]
    runs = [frozenset(c) for size in range(len(held) + 1) for c in itertools.combinations(held, size)]
    movable = [h.traj.index for i in model.instances if i is not model.instances[k] for h in i.held
               if not h.running] if model.job.moves else []
    moves = [c for size in range(len(movable) + 1) for c in itertools.combinations(movable, size)]
    return [(run | {x.index for x in new} | set(moved), new, moved) for run in runs for new in news
            for moved in moves]


def exact(job: BoundedJob, upper: float = math.inf) -> BoundedSchedule:
    """The shortest schedule of the model, by exhaustive search (below ``upper`` if given, e.g. a
    heuristic's makespan plus a margin; inf if none is): tiny cases only."""
    return BoundedSchedule(_search(_StepModel(job), _every_choice, upper, {}), job.tokens)


Held = TypeVar("Held")  # what an instance holds: a running trajectory, in whichever form the caller keeps


def _pause_to_fit(running: list[Held], context: Callable[[Held], int], index: Callable[[Held], int],
                  budget: float) -> list[Held]:
    """Pause the lowest-priority running trajectories until the next step fits the KV."""
    paused: list[Held] = []
    kv = sum(map(context, running)) + len(running)
    while kv > budget and len(running) > 1:
        h = max(running, key=index)
        running.remove(h)
        paused.append(h)
        kv -= context(h) + 1
    return paused


def greedy_policy(job: BoundedJob, caps: Sequence[int]) -> Policy:
    """The heuristic's choice at a boundary of instance ``k``: when the next step would not fit the
    KV, pause its lowest-priority running trajectories; at events only, start the startable ones
    ``routes`` gives it, and run what it holds in priority order while it fits and ``k`` runs
    fewer than its cap (head of line, as vLLM's waiting queue)."""
    router = Router(job)

    def catch_up(model: _StepModel) -> None:
        # route what the instances learn of at their boundary as the heuristic does at publication
        trainer = model.trainer
        steps = [(0.0, router.first_steps())] + [(trainer.published[v], v + 1 + job.eta)
                                                  for v in range(1, trainer.known + 1)]
        for p, step in steps:
            if p <= model.now and step > router.routed:
                outstanding = [0.0] * len(job.slowdowns)
                for index, where in router.route.items():
                    if model.ended.get(index, math.inf) >= p:
                        x = job.trajectories()[index]
                        outstanding[where] += x.length + x.prompt
                router.route_through(step, outstanding)

    def choose(model: _StepModel, k: int, startable: list[OracleTrajectory], event: bool) -> list[Choice]:
        catch_up(model)
        route = router.route
        held = model.instances[k].held
        running = [h for h in held if h.running]
        _pause_to_fit(running, lambda h: h.context, lambda h: h.traj.index, model.budget)
        run = [h.traj.index for h in running]
        new = tuple(x for x in startable if route[x.index] == k) if event else ()
        if event:
            kv = sum(h.context for h in running) + len(running)
            waiting = sorted([(h.traj.index, h.context) for h in held if h not in running]
                             + [(x.index, x.prompt) for x in new])
            for index, context in waiting:
                if len(run) >= caps[k] or kv + context + 1 > model.budget:
                    break
                run.append(index)
                kv += context + 1
            if job.moves and len(run) == len(running) + len(waiting):  # all its own run: take others'
                others = sorted((h.traj.index, h.context) for i in model.instances if i is not model.instances[k]
                                for h in i.held if not h.running)
                moved = []
                for index, context in others:
                    if len(run) >= caps[k] or kv + context + 1 > model.budget:
                        break
                    run.append(index)
                    moved.append(index)
                    route[index] = k
                    kv += context + 1
                return [(frozenset(run), new, tuple(moved))]
        return [(frozenset(run), new, ())]

    return choose


# ---------------------------------------------------------------------- the heuristic, boundary by boundary


class _Paced:
    __slots__ = ("slowdown", "running", "waiting", "routed", "held", "steps", "clock", "prefill", "token")

    def __init__(self, slowdown: float):
        self.slowdown = slowdown
        self.running: list[tuple[int, int, OracleTrajectory]] = []  # (fin, base, traj) by fin
        self.waiting: list[tuple[int, OracleTrajectory, int]] = []  # (index, traj, done): started, not running
        self.routed: deque[OracleTrajectory] = deque()  # routed here, not started yet, the next one last
        self.held = 0  # sum of the running bases: they hold held + n * steps tokens (context base + steps)
        self.steps = 0  # its decode steps so far
        self.clock = 0.0  # time of its last boundary
        self.prefill = 0.0  # prefill seconds of the step after that boundary
        self.token = 0  # events carrying an older token are stale

    def time_after(self, cost: CostModel, steps: int) -> float:
        n = len(self.running)
        kv = cost.kv_units(self.held + n * self.steps)
        return self.clock + self.slowdown * (self.prefill + cost.decode_time(kv, n, steps))

    def steps_to_reach(self, cost: CostModel, t: float) -> int:
        """The fewest steps (>= 1) after which its boundary is at ``t`` or later."""
        n = len(self.running)
        kv = cost.kv_units(self.held + n * self.steps)
        steps = max(1, cost.steps_within(kv, n, (t - self.clock) / self.slowdown - self.prefill))
        return steps if self.time_after(cost, steps) >= t else steps + 1

    def run(self, traj: OracleTrajectory, done: int) -> None:
        base = traj.prompt + done - self.steps
        bisect.insort(self.running, (self.steps + traj.length - done, base, traj))
        self.held += base

    def next_boundary(self, budget: float) -> tuple[int, bool]:
        """Steps to its next boundary that matters, and whether it is an event (an end) or only a
        pause (the step after it would not fit the KV)."""
        n = len(self.running)
        ends = self.running[0][0] - self.steps
        full = math.floor((budget - self.held) / n) - self.steps
        return (ends, True) if ends <= full else (full, False)


_PUBLISH = -1


def _run_greedy(job: BoundedJob, caps: Sequence[int]) -> tuple[float, list[float], list[float]]:
    """``replay(job, greedy_policy(job, caps))``, jumping from boundary to boundary that matters:
    between them an instance's batch changes only in its KV. Returns the makespan (inf: it
    stalled), each trajectory's start time and each version's publication time."""
    cost, budget = job.cost, job.cost.kv_budget / job.cost.k5
    trainer = _Trainer(job)
    starts = [math.inf] * len(job.trajectories())
    router, outstanding = Router(job), [0.0] * len(job.slowdowns)
    fleet = [_Paced(f) for f in job.slowdowns]

    def route(step: int) -> None:
        for x, k in router.route_through(step, outstanding):
            fleet[k].routed.appendleft(x)
            outstanding[k] += x.length + x.prompt

    route(router.first_steps())
    # (time, instance or _PUBLISH, 0 for an event / 1 for a pause only, its steps then, token)
    events: list[tuple[float, int, int, int, int]] = [(0.0, k, 0, 0, 0) for k in range(len(fleet))]
    while events:
        t, k, quiet, target, token = heapq.heappop(events)
        if k == _PUBLISH:
            route(target + 1 + job.eta)  # the version published now lets that step start
            for k, inst in enumerate(fleet):
                if not inst.running:
                    heapq.heappush(events, (t, k, 0, inst.steps, inst.token))
                elif (steps := inst.steps_to_reach(cost, t)) < inst.running[0][0] - inst.steps:
                    heapq.heappush(events, (inst.time_after(cost, steps), k, 0, inst.steps + steps, inst.token))
            continue
        inst = fleet[k]
        if token != inst.token:
            continue
        inst.steps, inst.clock, inst.prefill = target, t, 0.0
        while inst.running and inst.running[0][0] == inst.steps:
            _, base, traj = inst.running.pop(0)
            inst.held -= base
            outstanding[k] -= traj.length + traj.prompt
            news = trainer.complete(traj.step, t)
            for version, p in enumerate(news, start=trainer.known - len(news) + 1):
                heapq.heappush(events, (p, _PUBLISH, 0, version, 0))
        if trainer.finished:
            return trainer.end, starts, trainer.published
        for entry in _pause_to_fit(list(inst.running), lambda e, now=inst.steps: e[1] + now, lambda e: e[2].index,
                                   budget):
            inst.running.remove(entry)
            inst.held -= entry[1]
            bisect.insort(inst.waiting, (entry[2].index, entry[2], entry[1] + inst.steps - entry[2].prompt))
        if not quiet:
            while inst.routed and (release := trainer.release(inst.routed[-1].step)) is not None and release <= t:
                x = inst.routed.pop()
                starts[x.index] = t
                bisect.insort(inst.waiting, (x.index, x, 0))
            kv = inst.held + len(inst.running) * (inst.steps + 1)
            while inst.waiting and len(inst.running) < caps[k]:
                _, traj, done = inst.waiting[0]
                if kv + traj.prompt + done + 1 > budget:
                    break
                inst.waiting.pop(0)
                inst.run(traj, done)
                if done == 0:
                    inst.prefill += job.prefill_seconds(traj.prompt)
                kv += traj.prompt + done + 1
            if job.moves and not inst.waiting:
                _take_from_others(job, fleet, k, caps[k], kv, budget, outstanding, router)
        inst.token += 1
        if inst.running:
            steps, event = inst.next_boundary(budget)
            heapq.heappush(events, (inst.time_after(cost, steps), k, 0 if event else 1, inst.steps + steps,
                                    inst.token))
    return math.inf, starts, trainer.published


def _take_from_others(job: BoundedJob, fleet: list[_Paced], k: int, cap: int, kv: float, budget: float,
                      outstanding: list[float], router: Router) -> None:
    """Instance ``k`` has run all its own and has room: it takes the highest-priority trajectories
    started on other instances that do not run there, while they fit and it runs fewer than
    ``cap``, each prefilled again (its prompt and what it generated)."""
    inst = fleet[k]
    while len(inst.running) < cap:
        source = min((j for j, other in enumerate(fleet) if j != k and other.waiting),
                      key=lambda j: fleet[j].waiting[0][0], default=None)
        if source is None:
            return
        _, traj, done = fleet[source].waiting[0]
        if kv + traj.prompt + done + 1 > budget:
            return
        fleet[source].waiting.pop(0)
        inst.run(traj, done)
        inst.prefill += job.prefill_seconds(traj.prompt + done)
        kv += traj.prompt + done + 1
        outstanding[source] -= traj.length + traj.prompt
        outstanding[k] += traj.length + traj.prompt
        router.route[traj.index] = k


def heuristic_caps(job: BoundedJob) -> list[tuple[int, ...]]:
    """The per-instance concurrency caps the heuristic tries: about one, one and a half and two
    times as many trajectories of mean final context as fill the KV budget, on every instance, or
    on the fastest and fewer on the others in proportion to their speed."""
    lengths = [n for g in range(job.steps * job.batch_size) for n in job.groups[g]]
    prompts = [job.prompt(g) for g in range(job.steps * job.batch_size) for _ in job.groups[g]]
    fill = job.cost.kv_budget / job.cost.k5 / (sum(lengths) + sum(prompts)) * len(lengths)
    fastest, out = min(job.slowdowns), set()
    for cap in {max(1, min(job.max_running, round(fill * m))) for m in (1, 1.5, 2)}:
        out.add((cap,) * len(job.slowdowns))
        out.add(tuple(max(1, math.floor(cap * fastest / f + 1e-9)) for f in job.slowdowns))
    return sorted(out)


def heuristic(job: BoundedJob) -> BoundedSchedule:
    """The best greedy schedule (``greedy_policy``) over ``heuristic_caps``, under the job's bound
    and under the next tighter one (whose schedules respect the job's too: the greedy schedule is
    not always shorter under a looser bound), with and without moves when the job allows them."""
    variants = {(eta, moves) for eta in {max(0, job.eta - 1), job.eta} for moves in {False, job.moves}}
    runs = {(eta, moves, caps): _run_greedy(replace(job, eta=eta, moves=moves), caps)
            for eta, moves in variants for caps in heuristic_caps(job)}
    eta, moves, caps = min(runs, key=lambda key: (runs[key][0], -key[0], key[1], key[2]))
    makespan, starts, published = runs[eta, moves, caps]
    return BoundedSchedule(makespan, job.tokens, caps, tuple(starts), tuple(published), eta, moves)


def scenario_job(scenario: Scenario, eta: int, steps: int, instances: int) -> BoundedJob:
    """``oracle-eta``'s job on a simulated cluster: its workload's lengths and prompts, its
    instances' cost model, prefill, KV budget and persistent stragglers (no noise: its mean), the
    unbounded oracle's ``max_num_seqs``, and the split's trainer."""
    w = scenario.workload
    ids = [f"s{i // w.batch_size}-g{i % w.batch_size}" for i in range(steps * w.batch_size)]
    groups = tuple(tuple(w.target_length(g, f"{g}/m{m}")[0] for m in range(w.group_size)) for g in ids)
    sim, trainer = scenario.sim, scenario.trainer
    return BoundedJob(groups, w.batch_size, steps, eta,
                      tuple(straggler_slowdowns(instances, scenario.straggler_sigma, sim.seed)), sim.cost,
                      ORACLE_SPEC.max_num_seqs or sim.max_running, trainer.step_overhead_s,
                      trainer.gpu_seconds_per_token / scenario.train_gpus(instances), trainer.push_s,
                      tuple(w.prompt_length(g) for g in ids), sim.prefill_seconds_per_token,
                      sim.prefill_attention_seconds, moves=True)
