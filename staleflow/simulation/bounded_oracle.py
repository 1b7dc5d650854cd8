"""``oracle-eta``: a clairvoyant schedule that respects the staleness bound exactly.

The ``oracle`` system has no bound at all, so the gap to it mixes what the bound costs with what
coordination loses. This module computes the best schedule of a job that knows every response
length in advance, under the same bound, on a cluster reduced to what the bound constrains.

The model (pure, no I/O):

* the rollout side is a set of decode slots; slot ``j`` generates one token every
  ``token_s[j]`` seconds and runs one trajectory at a time, start to end (weights change between
  trajectories for free and no KV is recomputed: no sync, prefill or preemption cost);
* step ``k`` (1-based) trains the ``k``-th batch of ``B`` groups in sampling order, as the strict
  bounded systems do (free to choose, a clairvoyant scheduler would train whichever groups make
  tokens per second largest, the longest ones when a step's overhead dominates: another job);
  it starts once its groups are complete and step ``k - 1`` has ended, and publishes version
  ``k`` ``push_s`` after it ends;
* the bound: every trajectory trained by step ``k`` (V_buf = k - 1) starts at a version
  ``>= k - 1 - eta``, i.e. not before version ``k - 1 - eta`` is published.

Throughput is the trained response tokens over the time the last step ends, as for every system.

``exact`` tries every order in which trajectories start, each placed on the slot that frees
first at the earliest time its step allows. With identical slots this is exact: placing an
optimal schedule's trajectories that way, sorted by start time, starts none of them later (at
most ``slots - 1`` earlier trajectories can still run when one starts), and every time in the
model only grows with the times before it. Its cost grows factorially: small cases only.

``heuristic`` runs at scale: the longest trajectory of a step first, onto the slot where it
finishes first (LPT list scheduling: with identical slots a step's trajectories finish within
Graham's bound, ``W / slots + (1 - 1 / slots) * p_max`` after its release, of its work ``W``).
The tests check it against ``exact`` on random small cases.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from staleflow.simulation.cluster import straggler_slowdowns
from staleflow.simulation.scenarios import Scenario
from staleflow.simulation.systems import ORACLE_SPEC


@dataclass(frozen=True)
class BoundedJob:
    """One job: the response lengths of every sampled group, in sampling order, and the cluster."""

    groups: tuple[tuple[int, ...], ...]  # response tokens per member, per group, in sampling order
    batch_size: int
    steps: int
    eta: int
    token_s: tuple[float, ...]  # seconds per token of each decode slot
    step_s: tuple[float, ...]  # duration of each training step (may depend on its batch: see step_seconds)
    push_s: float = 0.0
    train_overhead_s: float | None = None  # with train_s_per_token: step time from the batch's tokens
    train_s_per_token: float = 0.0
    prompt_tokens: tuple[int, ...] = ()  # per group (trained with the response)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.steps < 1 or self.eta < 0 or not self.token_s:
            raise ValueError("need batch_size >= 1, steps >= 1, eta >= 0 and at least one slot")
        if len(self.groups) < self.steps * self.batch_size:
            raise ValueError("not enough groups for the steps")

    def step_seconds(self, step: int, batch: Sequence[int]) -> float:
        if self.train_overhead_s is None:
            return self.step_s[step - 1]
        tokens = sum(sum(self.groups[g]) + len(self.groups[g]) * (self.prompt_tokens[g] if self.prompt_tokens else 0)
                     for g in batch)
        return self.train_overhead_s + self.train_s_per_token * tokens


@dataclass(frozen=True)
class BoundedSchedule:
    batches: tuple[tuple[int, ...], ...]  # group indexes per step
    makespan_s: float
    tokens: int

    @property
    def throughput(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def _simulate(job: BoundedJob, batches: Sequence[Sequence[int]], order: Sequence[tuple[int, int]]) -> float | None:
    """Makespan when trajectories ``(step, length)`` start in ``order``, each on the slot where it
    finishes first (slots of one speed: the one that frees first), not before its step's release;
    None when ``order`` starts a trajectory before every trajectory its release depends on."""
    speeds = sorted(set(job.token_s))
    free = [[0.0] * job.token_s.count(v) for v in speeds]  # heaps of free times, per speed
    left = [sum(len(job.groups[g]) for g in batch) for batch in batches]
    done_at = [0.0] * len(batches)
    published = [0.0] * (len(batches) + 1)  # version v is published at published[v]
    known = 0  # steps whose end (and publication) is known
    end = 0.0
    for step, length in order:
        version = step - 1 - job.eta
        if version > known:
            return None
        release = published[version] if version > 0 else 0.0
        best, finish = 0, math.inf
        for c, v in enumerate(speeds):
            f = max(free[c][0], release) + length * v
            if f < finish:
                best, finish = c, f
        heapq.heapreplace(free[best], finish)
        done_at[step - 1] = max(done_at[step - 1], finish)
        left[step - 1] -= 1
        while known < len(batches) and left[known] == 0:
            end = max(end, done_at[known]) + job.step_seconds(known + 1, batches[known])
            published[known + 1] = end + job.push_s
            known += 1
    return end


def _tokens(job: BoundedJob, batches: Sequence[Sequence[int]]) -> int:
    return sum(sum(job.groups[g]) for batch in batches for g in batch)


def exact(job: BoundedJob) -> BoundedSchedule:
    """The shortest schedule by exhaustive search over start orders: small cases only."""
    if len(set(job.token_s)) != 1:
        raise ValueError("the exact search assumes identical slots")
    batches = _in_sampling_order(job)
    jobs = [(k + 1, length) for k, batch in enumerate(batches) for g in batch for length in job.groups[g]]
    spans = (_simulate(job, batches, order) for order in set(itertools.permutations(jobs)))
    return BoundedSchedule(batches, min(m for m in spans if m is not None), _tokens(job, batches))


def _in_sampling_order(job: BoundedJob) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(k * job.batch_size, (k + 1) * job.batch_size)) for k in range(job.steps))


def heuristic(job: BoundedJob) -> BoundedSchedule:
    """Steps in order, the longest trajectory of a step first (LPT list scheduling)."""
    batches = _in_sampling_order(job)
    order = [(k + 1, length) for k, batch in enumerate(batches)
             for length in sorted((n for g in batch for n in job.groups[g]), reverse=True)]
    makespan = _simulate(job, batches, order)
    assert makespan is not None  # steps in order: every release is known when it is needed
    return BoundedSchedule(batches, makespan, _tokens(job, batches))


def scenario_job(scenario: Scenario, eta: int, steps: int, instances: int) -> BoundedJob:
    """``oracle-eta``'s job on a simulated cluster, relaxed on both sides of an instance's cost
    model (Eq. 11, at the job's mean context): each of its slots decodes as fast as a lone
    trajectory does, and it has as many slots as it takes to reach its best throughput (within its
    KV budget and ``max_num_seqs``). Persistent stragglers slow an instance's slots; the trainer is
    the split's."""
    w = scenario.workload
    ids = [f"s{i // w.batch_size}-g{i % w.batch_size}" for i in range(steps * w.batch_size)]
    groups = tuple(tuple(w.target_length(g, f"{g}/m{m}")[0] for m in range(w.group_size)) for g in ids)
    prompts = tuple(w.prompt_length(g) for g in ids)
    cost = scenario.sim.cost
    context = statistics.fmean(prompts) + statistics.fmean(n for group in groups for n in group) / 2
    fitting = max(1, min(ORACLE_SPEC.max_num_seqs or scenario.sim.max_running,
                         int(cost.kv_budget / (cost.k5 * context))))
    best = max(n / cost.step_latency(cost.kv_units(n * context), n) for n in range(1, fitting + 1))
    alone = cost.step_latency(cost.kv_units(context), 1)
    slots = math.ceil(best * alone)
    slowdowns = straggler_slowdowns(instances, scenario.straggler_sigma, scenario.sim.seed)
    trainer = scenario.trainer
    return BoundedJob(groups, w.batch_size, steps, eta, tuple(alone * f for f in slowdowns for _ in range(slots)),
                      (), push_s=trainer.push_s, train_overhead_s=trainer.step_overhead_s,
                      train_s_per_token=trainer.gpu_seconds_per_token / scenario.train_gpus(instances),
                      prompt_tokens=prompts)
