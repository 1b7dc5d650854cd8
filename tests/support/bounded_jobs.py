"""Random tiny bounded jobs (hypothesis strategies) for the exact search and the bounds checked
against it."""

from __future__ import annotations

from hypothesis import strategies as st

from staleflow.cost_model import CostModel
from staleflow.simulation.bounded_oracle import BoundedJob

jobs = st.builds(
    lambda b, g, steps, eta, instances, lengths, prompts, push, cost, slow, max_running, moves: BoundedJob(
        tuple(tuple(lengths[i * g:(i + 1) * g]) for i in range(steps * b)), b, steps, eta,
        tuple(slow[:instances]), cost, max_running, 1.0, 0.01, push, tuple(prompts[:steps * b]), 0.05,
        moves=moves),
    st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(0, 2), st.integers(1, 2),
    st.lists(st.integers(1, 4), min_size=12, max_size=12), st.lists(st.integers(0, 3), min_size=6, max_size=6),
    st.sampled_from([0.0, 0.5]),
    st.builds(lambda k1, k3, budget: CostModel(k1=k1, k2=0.2, k3=k3, k4=0.3, kv_budget=budget),
              st.sampled_from([0.0, 0.05]), st.sampled_from([0.1, 0.3]), st.integers(8, 16)),
    st.lists(st.sampled_from([1.0, 1.0, 1.7]), min_size=2, max_size=2), st.integers(1, 3), st.booleans(),
).filter(lambda j: sum(map(len, j.groups[:j.steps * j.batch_size])) <= 4)


# the exact search grows exponentially with the tokens it schedules: over six seeds, 60 jobs of up to
# 16 tokens took 1.6-35.6 s (9.5 s on average), of at most 10 tokens 0.4-2.1 s; a looser bound
# widens it further (30 jobs: 1.1-35.3 s; of at most 8 tokens 0.2-3.3 s). The properties that call
# it run on those smaller jobs, every shape of the strategy above still drawn.
exact_sized_jobs = jobs.filter(lambda j: j.tokens <= 10)
looser_sized_jobs = jobs.filter(lambda j: j.tokens <= 8)
