"""``oracle-eta``'s bounded clairvoyant schedule on instances whose pace follows their load: the
exact search on tiny cases, the heuristic against it and through the step-by-step model, the
bound in the schedule it returns, and hand-computed jobs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from support.bounded_jobs import exact_sized_jobs, looser_sized_jobs

from staleflow.cost_model import CostModel
from staleflow.simulation.bounded_oracle import (
    BoundedJob,
    BoundedSchedule,
    Router,
    exact,
    greedy_policy,
    heuristic,
    replay,
    scenario_job,
)
from staleflow.simulation.scenarios import scenario

ONE_SECOND_STEPS = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0, kv_budget=1000)  # a step takes 1 s, whatever runs
SECOND_PER_TRAJECTORY = CostModel(k1=0.0, k2=0.0, k3=1.0, k4=0.0, kv_budget=1000)  # a step takes n seconds


def job(groups, eta, instances=1, batch_size=1, steps=2, push_s=0.0, cost=ONE_SECOND_STEPS, **kw) -> BoundedJob:
    return BoundedJob(tuple(tuple(g) for g in groups), batch_size, steps, eta, (1.0,) * instances, cost,
                      kw.pop("max_running", 8), 1.0, push_s=push_s, **kw)


def both(j: BoundedJob) -> tuple[float, float]:
    return exact(j).makespan_s, heuristic(j).makespan_s


def test_the_bound_holds_a_step_back_until_its_oldest_version_is_published() -> None:
    # eta 0: step 2's trajectory waits for version 1 (step 1 ends at 2 + 1); eta 1: it starts at once
    assert both(job([[2], [3]], eta=0)) == (3 + 3 + 1, 3 + 3 + 1)
    assert both(job([[2], [3]], eta=1)) == (3 + 1, 3 + 1)
    assert both(job([[2], [3]], eta=0, push_s=0.5)) == (3 + 0.5 + 3 + 1, 3 + 0.5 + 3 + 1)


def test_an_instance_slows_down_as_it_runs_more() -> None:
    # a step takes n seconds: together, two trajectories of 2 tokens take 2 steps of 2 s
    assert both(job([[2, 2]], eta=0, steps=1, cost=SECOND_PER_TRAJECTORY)) == (4 + 1, 4 + 1)
    # on two instances each runs alone: 2 steps of 1 s
    assert both(job([[2, 2]], eta=0, steps=1, instances=2, cost=SECOND_PER_TRAJECTORY)) == (2 + 1, 2 + 1)


def test_the_kv_held_slows_a_step_and_a_straggler_slows_all_of_it() -> None:
    kv_bound = CostModel(k1=0.5, k2=0.0, k3=0.0, k4=1.0, kv_budget=1000)
    # prompt 2: steps read 2 then 3 units of KV: 1 + 1 then 1.5 + 1 seconds
    assert both(job([[2]], eta=0, steps=1, cost=kv_bound, prompt_tokens=(2,))) == (4.5 + 1, 4.5 + 1)
    slow = replace(job([[2]], eta=0, steps=1, cost=kv_bound, prompt_tokens=(2,)), slowdowns=(2.0,))
    assert both(slow) == (9 + 1, 9 + 1)


def test_a_full_kv_pauses_a_trajectory_and_it_resumes_where_it_was() -> None:
    # budget 5 tokens: two trajectories of 3 tokens (no prompt) cannot both hold their third token,
    # so one waits a step and finishes one step later (no prefill is charged twice)
    tight = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0, kv_budget=5)
    assert both(job([[3, 3]], eta=0, steps=1, cost=tight)) == (4 + 1, 4 + 1)
    roomy = replace(tight, kv_budget=6)
    assert both(job([[3, 3]], eta=0, steps=1, cost=roomy)) == (3 + 1, 3 + 1)


def test_a_first_run_is_prefilled_once() -> None:
    j = job([[2]], eta=0, steps=1, prompt_tokens=(4,), prefill_s_per_token=0.25)
    assert both(j) == (1 + 2 + 1, 1 + 2 + 1)


def test_the_router_balances_outstanding_work_by_speed() -> None:
    # four equal trajectories, the second instance twice as slow: it gets one of them
    j = replace(job([[5, 5, 5, 5], [5, 5]], eta=0, steps=2, instances=2), slowdowns=(1.0, 2.0))
    router = Router(j)
    assert sorted(k for _, k in router.route_through(router.first_steps(), [0.0, 0.0])) == [0, 0, 0, 1]
    # the next step, when the fast instance still has 20 tokens to do: both go to the idle slow one
    assert [k for _, k in router.route_through(2, [20.0, 0.0])] == [1, 1]


def test_bad_jobs_are_refused_with_what_to_fix() -> None:
    with pytest.raises(ValueError, match="eta >= 0"):
        job([[1], [1]], eta=-1)
    with pytest.raises(ValueError, match="not enough groups"):
        job([[1]], eta=0, steps=2)
    with pytest.raises(ValueError, match="must fit the KV budget"):
        job([[2000], [1]], eta=0)




def _bound_holds(j: BoundedJob, schedule: BoundedSchedule) -> bool:
    for x in j.trajectories():
        start = schedule.starts[x.index]
        version = max(v for v in range(j.steps + 1) if v == 0 or schedule.published[v] <= start)
        if version < x.step - 1 - j.eta:
            return False
    return True


@settings(max_examples=60, deadline=None)
@given(exact_sized_jobs)
def test_the_heuristic_is_a_schedule_of_the_model_never_shorter_than_the_exact_one(j: BoundedJob) -> None:
    fast = heuristic(j)
    assert fast.tokens == j.tokens and math.isfinite(fast.makespan_s)
    # the heuristic's jumps from event to event give the greedy policy's schedule, step by step
    assert fast.eta is not None and fast.eta <= j.eta and fast.caps
    scheduled = replace(j, eta=fast.eta, moves=fast.moves)
    assert replay(scheduled, greedy_policy(scheduled, fast.caps)) == pytest.approx(fast.makespan_s, rel=1e-9)
    best = exact(j, fast.makespan_s * (1 + 1e-9))
    assert best.makespan_s <= fast.makespan_s * (1 + 1e-9)
    assert _bound_holds(j, fast)


@settings(max_examples=30, deadline=None)
@given(looser_sized_jobs)
def test_a_looser_bound_never_lengthens_the_best_schedule(j: BoundedJob) -> None:
    strict = exact(j, heuristic(j).makespan_s * (1 + 1e-9)).makespan_s
    assert exact(replace(j, eta=j.eta + 1), strict * (1 + 1e-9)).makespan_s <= strict * (1 + 1e-9)


def test_a_paused_trajectory_moves_to_a_free_instance_and_is_prefilled_there_again() -> None:
    # two trajectories of 4 tokens, prompt 1, one at a time per instance; instance 1 three times slower
    j = BoundedJob(((4, 4),), 1, 1, 0, (1.0, 3.0), ONE_SECOND_STEPS, 1, 1.0, prefill_s_per_token=0.25,
                   prompt_tokens=(1,))
    # without moves the second waits for the fast instance: 2 x (prefill 0.25 + 4 steps), then 1 s of training
    assert exact(j).makespan_s == pytest.approx(2 * 4.25 + 1)
    # with them it generates a token on the slow one (3 x 1.25 s), pauses, and the fast one takes it when
    # free at 4.25: prefill of its prompt and token (2 x 0.25), then its 3 last steps
    assert exact(replace(j, moves=True)).makespan_s == pytest.approx(4.25 + 0.5 + 3 + 1)


@settings(max_examples=30, deadline=None)
@given(looser_sized_jobs)
def test_moves_never_lengthen_the_best_schedule(j: BoundedJob) -> None:
    fixed = exact(replace(j, moves=False), heuristic(replace(j, moves=False)).makespan_s * (1 + 1e-9)).makespan_s
    assert exact(replace(j, moves=True), fixed * (1 + 1e-9)).makespan_s <= fixed * (1 + 1e-9)


def test_a_simulated_cluster_becomes_a_bounded_job_and_its_schedule_keeps_the_bound() -> None:
    ci = replace(scenario("ci"), straggler_sigma=0.25)
    j = scenario_job(ci, eta=1, steps=ci.steps, instances=2)
    assert len(j.groups) == ci.steps * ci.workload.batch_size
    assert all(1 <= n <= ci.workload.max_response_tokens for g in j.groups for n in g)
    assert len(j.slowdowns) == 2 and j.slowdowns[0] != j.slowdowns[1] and j.moves
    schedule = heuristic(j)
    assert schedule.throughput > 0 and _bound_holds(j, schedule)
    scheduled = replace(j, eta=schedule.eta, moves=schedule.moves)
    assert replay(scheduled, greedy_policy(scheduled, schedule.caps)) == pytest.approx(schedule.makespan_s, rel=1e-9)
    # a looser bound lets the next steps generate sooner
    assert heuristic(replace(j, eta=3)).makespan_s < schedule.makespan_s
