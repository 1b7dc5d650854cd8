"""``oracle-eta``: an upper bound on the throughput of any schedule that keeps the staleness bound.

A clairvoyant schedule (``bounded_oracle.heuristic``) is a lower estimate of the best one, so a
system can pass it. This module bounds the best one from above: it lower-bounds the time the last
training step ends under every schedule of a relaxed model, whatever the batches, the order and
the instances. The relaxation, of ``BoundedJob`` (pure, no I/O):

* **batches are free**: the trained groups are the job's (the first ``steps x B`` sampled), but
  any ``B`` of them may form any step's batch, so every term below takes the cheapest batches
  the term can have (sorted sums), each term on its own: a real schedule's batches can only do
  worse;
* **moves are free**: a trajectory may run on any instance at any step and is never prefilled
  twice; a trajectory started at version ``v`` may be trained only by steps ``k`` with
  ``k - 1 - eta <= v``, so step ``k``'s trajectories start no sooner than version ``k - 1 - eta``
  is published, as in the model;
* **rollout is a fluid and a critical path**: every decode step of an instance takes at least the
  cost model's latency at its KV and batch (Eq. 11) times its straggler factor, so the cluster
  does at most ``sum(1 / slowdown)`` seconds of model work a second, and one trajectory generates
  at most one token a step on the fastest instance running it alone. The work of a set of
  trajectories is at least ``k1 * k5 * (its contexts, summed over its tokens) + k3 * tokens +
  k4 * steps + their prefill``, ``steps`` at least ``tokens / max_running`` and ``k5 *
  contexts / kv_budget`` (a step's KV fits the budget);
* the trainer runs steps in order, each once its batch is complete, for ``train_seconds`` of its
  tokens, and publishes ``push_s`` after it ends.

``schedule_bound`` then takes the longest chain of these lower bounds to the end of the last step:
a step ends at least one step's training after the previous step ended, or after its batch (or a
run of batches) could be generated from the publication that released it. Every term is a lower
bound on the same quantity in every schedule, so the result is never above the shortest schedule
(the tests check it against ``bounded_oracle.exact`` with moves), and its throughput is never
below any schedule's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from staleflow.simulation.bounded_oracle import BoundedJob


@dataclass(frozen=True)
class ScheduleBound:
    makespan_s: float  # no schedule ends its last step sooner
    tokens: int
    binding: str  # what set it: "trainer" (steps back to back), "critical path" or "rollout" (the fluid)

    @property
    def throughput(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


class _Cheapest:
    """Per quantity, the sum over the cheapest ``n`` batches (``n x B`` groups, sorted)."""

    def __init__(self, job: BoundedJob):
        b, cost = job.batch_size, job.cost
        groups = range(job.steps * job.batch_size)
        fastest = min(job.slowdowns)
        lengths = [np.array(job.groups[g], dtype=float) for g in groups]
        prompts = np.array([job.prompt(g) for g in groups], dtype=float)
        # the longest member of a group alone on the fastest instance: its prefill, then a token a step
        critical = np.array([fastest * (job.prefill_seconds(int(p)) + cost.decode_time(cost.kv_units(p), 1, int(n.max())))
                             for n, p in zip(lengths, prompts, strict=True)])
        tokens = np.array([n.sum() for n in lengths])
        contexts = np.array([(n * p + n * (n - 1) / 2).sum() for n, p in zip(lengths, prompts, strict=True)])
        prefill = np.array([len(n) * job.prefill_seconds(int(p)) for n, p in zip(lengths, prompts, strict=True)])
        # model work that scales with the trajectories themselves; the per-step terms need the sums
        direct = cost.k1 * cost.k5 * contexts + prefill
        trained = tokens + np.array([len(n) for n in lengths]) * prompts
        prefix = lambda values: np.concatenate(([0.0], np.cumsum(np.sort(values))[b - 1::b]))  # noqa: E731
        self.critical = np.sort(critical)[b - 1::b]  # the i-th cheapest batch's longest: >= the (i B)-th group's
        self.critical_sums = np.concatenate(([0.0], np.cumsum(self.critical)))
        self.trained = prefix(trained)
        self.group_trained = np.sort(trained)
        self.direct, self.tokens, self.contexts = prefix(direct), prefix(tokens), prefix(contexts)
        self.job, self.capacity = job, float(sum(1.0 / f for f in job.slowdowns))

    def train(self, steps: int) -> float:
        """The least training time of ``steps`` steps."""
        job = self.job
        return steps * job.train_overhead_s + job.train_s_per_token * self.trained[steps]

    def rollout(self, batches: int) -> float:
        """The least time the whole cluster needs to generate ``batches`` batches (the fluid)."""
        cost, job = self.job.cost, self.job
        tokens, contexts = self.tokens[batches], self.contexts[batches]
        steps = max(tokens / job.max_running, cost.k5 * contexts / cost.kv_budget)
        work = self.direct[batches] + max(cost.k3 * tokens, cost.k2 * steps) + cost.k4 * steps
        return work / self.capacity


def schedule_bound(job: BoundedJob) -> ScheduleBound:
    """The least makespan of any schedule of the relaxed model of the module docstring."""
    cheapest = _Cheapest(job)
    steps, eta, push = job.steps, job.eta, job.push_s
    ends = [0.0] * (steps + 1)  # ends[m]: no schedule ends step m sooner
    why = [""] * (steps + 1)

    def released(j: int) -> float:
        """No trajectory of step ``j`` starts sooner."""
        version = j - 1 - eta
        return 0.0 if version <= 0 else ends[version] + push

    for m in range(1, steps + 1):
        best, reason = 0.0, ""
        # steps k..m back to back after step k's generation; k's batch came from a run of batches j..k
        for k in range(1, m + 1):
            after = cheapest.train(m - k + 1)
            # from step 1 on, steps back to back are the trainer's bound, whatever came before
            for j in range(1, k + 1):
                fluid = released(j) + cheapest.rollout(k - j + 1)
                if fluid + after > best:
                    best, reason = fluid + after, "trainer" if k == 1 else "rollout"
            critical = released(k) + cheapest.critical[0] + after
            if critical > best:
                best, reason = critical, "trainer" if k == 1 else "critical path"
        chain, chain_reason = _chain(cheapest, m, eta, push)
        if chain > best:
            best, reason = chain, chain_reason
        ends[m], why[m] = best, reason
    interleaved = _interleaved_chains(cheapest, steps, eta, push)
    if interleaved > ends[steps]:
        return ScheduleBound(interleaved, job.tokens, "critical path")
    return ScheduleBound(ends[steps], job.tokens, why[steps])


def _chain(cheapest: _Cheapest, m: int, eta: int, push: float) -> tuple[float, str]:
    """The chains of ``g`` releases to step ``m``, each a batch's longest trajectory after the
    publication that released it, with every step between them trained back to back: each
    batch's critical path and training the cheapest ones such a chain can have."""
    best, reason = 0.0, ""
    for g in range(1, 2 + (m - 1) // (eta + 1)):
        trained = m - (g - 1) * eta
        value = cheapest.train(trained) + cheapest.critical_sums[g] + (g - 1) * push
        if value > best:
            best, reason = value, "trainer" if g == 1 else "critical path"
    return best, reason


def _interleaved_chains(cheapest: _Cheapest, steps: int, eta: int, push: float) -> float:
    """The mean of the ``eta + 1`` chains of releases ``r, r + eta + 1, r + 2 (eta + 1), ...``, each
    followed by the steps after its last one trained back to back. Every step is on exactly one
    chain, so every batch's longest trajectory counts once whatever the batches: the mean is at
    least the sum of all the batches' critical paths over the chains, and of each step's training
    weighted by how many chains it lies on or after (the largest groups in the least weighted
    steps, the least the batches can make it)."""
    job, chains = cheapest.job, min(steps, eta + 1)
    weight = np.zeros(steps + 1)
    for first in range(1, chains + 1):
        last = first + (steps - first) // (eta + 1) * (eta + 1)
        weight[first:last + 1:eta + 1] += 1
        weight[last + 1:] += 1
    weight = weight[1:] / chains
    slots = np.sort(np.repeat(weight, job.batch_size))[::-1]  # the heaviest steps get the smallest groups
    training = float(weight.sum() * job.train_overhead_s + job.train_s_per_token * slots @ cheapest.group_trained)
    return training + cheapest.critical_sums[steps] / chains + (steps - chains) * push / chains
