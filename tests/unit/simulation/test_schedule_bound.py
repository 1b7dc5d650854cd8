"""``oracle-eta``, the upper bound under the staleness bound (``schedule_bound``): hand-computed
jobs, never above the exact schedule of the model (moves allowed or not) on random tiny jobs, and
never passed by a simulated system that keeps the bound, whatever the seed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.bounded_jobs import exact_sized_jobs

from staleflow.cost_model import CostModel
from staleflow.simulation.bounded_oracle import BoundedJob, exact, heuristic, scenario_job
from staleflow.simulation.experiment import Point, SimulatedJob, run_job
from staleflow.simulation.scenarios import Scenario, scenario
from staleflow.simulation.schedule_bound import schedule_bound
from staleflow.simulation.systems import SystemSpec, catalog

ONE_SECOND_STEPS = CostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0, kv_budget=1000)  # a step takes 1 s, whatever runs


def job(groups, eta, batch_size=1, steps=2, **kw) -> BoundedJob:
    return BoundedJob(tuple(tuple(g) for g in groups), batch_size, steps, eta, kw.pop("slowdowns", (1.0,)),
                      kw.pop("cost", ONE_SECOND_STEPS), 8, 1.0, **kw)


def test_a_chain_of_releases_is_the_bound_when_nothing_overlaps() -> None:
    # eta 0: step 2 starts at version 1; 2 s of generation, 1 s of training, 0.5 s of push, 3 s, 1 s
    j = job([[2], [3]], eta=0, push_s=0.5)
    assert schedule_bound(j).makespan_s == pytest.approx(exact(j).makespan_s) == pytest.approx(7.5)


def test_the_bound_lets_any_group_train_first() -> None:
    # eta 1, both groups start at 0 on one instance. In sampling order step 1 waits for the 4-token
    # group (ends at 4 + 1, step 2 at 6); training the 1-token group first ends at 2, then 5.
    j = job([[4], [1]], eta=1)
    assert exact(j).makespan_s == pytest.approx(6)
    assert schedule_bound(j).makespan_s <= 5


def test_a_straggler_lowers_the_fluid_but_not_the_fastest_critical_path() -> None:
    # one trajectory of 10 tokens: its steps on the fastest instance are the bound, however slow the other
    j = job([[10]], eta=0, steps=1, slowdowns=(1.0, 3.0))
    assert schedule_bound(j).makespan_s == pytest.approx(10 + 1)
    assert schedule_bound(replace(j, slowdowns=(2.0, 3.0))).makespan_s == pytest.approx(20 + 1)


@settings(max_examples=20, deadline=None)
@given(exact_sized_jobs)
def test_the_bound_is_never_above_the_exact_schedule_of_the_model_with_moves(j: BoundedJob) -> None:
    # with moves the model's best schedule is never longer than without (test_bounded_oracle)
    moving = replace(j, moves=True)
    best = exact(moving, heuristic(moving).makespan_s * (1 + 1e-9)).makespan_s
    bound = schedule_bound(j)
    assert bound.makespan_s <= best * (1 + 1e-9) and bound.tokens == j.tokens


def _bound_keepers() -> list[SystemSpec]:
    return [s for s in catalog() if s.keeps_bound]


def _check_no_system_passes_the_bound(cluster: Scenario, system: SystemSpec, eta: int, instances: int,
                                      steps: int) -> None:
    """``system`` at ``instances`` rollout instances against the bound at the same split; a
    colocated one (rollout and training alternate on every GPU) against the best split's, as
    ``bench systems`` compares it."""
    splits = cluster.rollout_candidates if system.colocated else (instances,)
    if system.colocated:
        instances = cluster.colocated_instances
    run = run_job(SimulatedJob(Point(0, eta, cluster), system, instances, steps))
    assert run.violations == 0
    bound = max((schedule_bound(scenario_job(cluster, eta, steps, n)) for n in splits), key=lambda b: b.throughput)
    assert run.throughput <= bound.throughput, (system.name, bound.binding)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 1000), st.sampled_from([0.0, 0.25, 0.5]), st.integers(1, 4), st.sampled_from(_bound_keepers()),
       st.sampled_from([2, 3]))
def test_no_simulated_system_that_keeps_the_bound_passes_it(seed: int, sigma: float, eta: int, system: SystemSpec,
                                                            instances: int) -> None:
    cluster = replace(scenario("ci", seed), straggler_sigma=sigma)
    _check_no_system_passes_the_bound(cluster, system, eta, instances, cluster.steps)


@pytest.mark.smoke  # paper-scale simulations, tens of minutes: run with -m smoke
@pytest.mark.timeout(3600)
@settings(max_examples=16, deadline=None)
@given(st.sampled_from(["ci", "paper-20k", "paper-40k", "paper-dense-32b"]), st.integers(0, 1000),
       st.sampled_from([0.0, 0.25]), st.integers(1, 4), st.sampled_from(_bound_keepers()))
def test_no_simulated_system_passes_the_bound_on_any_preset(name: str, seed: int, sigma: float, eta: int,
                                                            system: SystemSpec) -> None:
    cluster = replace(scenario(name, seed), straggler_sigma=sigma)
    _check_no_system_passes_the_bound(cluster, system, eta, cluster.rollout_candidates[0], min(cluster.steps, 4))
