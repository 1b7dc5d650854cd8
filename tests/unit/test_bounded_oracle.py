"""``oracle-eta``'s bounded clairvoyant schedule: the exact search on small cases, the heuristic
against it, and the bound's effect on hand-computed jobs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.simulation.bounded_oracle import BoundedJob, exact, heuristic, scenario_job
from staleflow.simulation.scenarios import scenario


def job(groups, eta, slots=1, batch_size=1, steps=2, push_s=0.0) -> BoundedJob:
    return BoundedJob(tuple(tuple(g) for g in groups), batch_size, steps, eta, (1.0,) * slots, (),
                      push_s=push_s, train_overhead_s=1.0)


def test_the_bound_holds_a_step_back_until_its_oldest_version_is_published() -> None:
    # eta 0: step 2's trajectory waits for version 1 (step 1 ends at 2 + 1); eta 1: it starts at once
    assert exact(job([[2], [3]], eta=0)).makespan_s == 3 + 3 + 1
    assert exact(job([[2], [3]], eta=1)).makespan_s == 2 + 3 + 1
    assert exact(job([[2], [3]], eta=0, push_s=0.5)).makespan_s == 3 + 0.5 + 3 + 1


def test_with_eta_1_the_next_step_generates_beside_the_current_one() -> None:
    # two slots: step 2's trajectory starts at once beside step 1's, and training waits only for it
    assert exact(job([[1], [5]], eta=1, slots=2)).makespan_s == 5 + 1
    assert heuristic(job([[1], [5]], eta=1, slots=2)).makespan_s == 5 + 1


jobs = st.builds(
    lambda b, g, steps, eta, slots, lengths, push: job(
        [lengths[i * g:(i + 1) * g] for i in range(steps * b)], eta, slots, b, steps, push),
    st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(0, 2), st.integers(1, 3),
    st.lists(st.integers(1, 20), min_size=12, max_size=12), st.sampled_from([0.0, 1.0]),
).filter(lambda j: sum(map(len, j.groups)) <= 6)


@settings(max_examples=60, deadline=None)
@given(jobs)
def test_the_heuristic_is_never_shorter_than_the_exact_schedule(j: BoundedJob) -> None:
    best, fast = exact(j), heuristic(j)
    assert best.makespan_s <= fast.makespan_s + 1e-9
    assert best.tokens == fast.tokens == sum(map(sum, j.groups))


@settings(max_examples=40, deadline=None)
@given(jobs)
def test_a_looser_bound_never_lengthens_the_best_schedule(j: BoundedJob) -> None:
    looser = BoundedJob(j.groups, j.batch_size, j.steps, j.eta + 1, j.token_s, j.step_s, j.push_s,
                        j.train_overhead_s, j.train_s_per_token)
    assert exact(looser).makespan_s <= exact(j).makespan_s + 1e-9


def test_a_simulated_cluster_becomes_a_bounded_job() -> None:
    ci = scenario("ci")
    j = scenario_job(ci, eta=2, steps=ci.steps, instances=2)
    assert len(j.groups) == ci.steps * ci.workload.batch_size
    assert all(1 <= n <= ci.workload.max_response_tokens for g in j.groups for n in g)
    assert len(j.token_s) % 2 == 0 and heuristic(j).throughput > 0
