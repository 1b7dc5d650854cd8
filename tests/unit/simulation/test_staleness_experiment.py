"""The staleness-vs-convergence experiment's plan and the numbers it reports per run."""

from __future__ import annotations

from pathlib import Path

import pytest

from staleflow.staleness_experiment import PlannedRun, run_numbers, staleness_plan


def test_plan_runs_each_bound_then_the_unbounded_contrast() -> None:
    plan = staleness_plan([0, 1, 2], steps=20, out=Path("runs"))
    assert [(r.eta, r.bounded, r.state_dir) for r in plan] == [
        (0, True, Path("runs/eta0")), (1, True, Path("runs/eta1")), (2, True, Path("runs/eta2")),
        (20, False, Path("runs/unbounded"))]
    assert plan[-1].label.startswith("no bound")


def test_plan_drops_duplicate_bounds_and_can_leave_out_the_contrast() -> None:
    plan = staleness_plan([2, 0, 2], steps=5, out=Path("x"), unbounded=False)
    assert [r.eta for r in plan] == [2, 0]


@pytest.mark.parametrize(("etas", "steps", "unbounded"), [([-1], 5, True), ([0], 0, True), ([], 5, False)])
def test_plan_refuses_what_cannot_run(etas: list[int], steps: int, unbounded: bool) -> None:
    with pytest.raises(ValueError):
        staleness_plan(etas, steps, Path("x"), unbounded)


def test_each_run_is_a_fresh_job_at_its_bound() -> None:
    run = PlannedRun("eta = 1", 1, Path("runs/eta1"), True)
    args = run.up_arguments(steps=7, seed=3)
    assert args[args.index("--eta") + 1] == "1" and args[args.index("--steps") + 1] == "7"
    assert args[args.index("--seed") + 1] == "3" and args[args.index("--state-dir") + 1] == "runs/eta1"
    assert "--fresh" in args and "--json-log" in args


def test_run_numbers_reports_the_curve_its_ends_and_the_staleness_trained_on() -> None:
    rewards = [0.1, 0.2, 0.1, 0.2, 0.1, 0.5, 0.6, 0.7, 0.6, 0.6]
    steps = [{"mean_reward": r, "finished_at": 10.0 * (i + 1), "staleness": {0: 4, 1: 4} if i else {0: 8},
              "response_tokens": 100} for i, r in enumerate(rewards)]
    run = PlannedRun("eta = 1", 1, Path("runs/eta1"), True)
    numbers = run_numbers(run, steps, {"wall_seconds": 101.0, "tokens_per_second": 9.9, "staleness_violations": 0})
    assert numbers["first_5"] == pytest.approx(0.14) and numbers["last_5"] == pytest.approx(0.6)
    assert numbers["rise"] == pytest.approx(0.46)
    assert numbers["rewards"] == rewards and numbers["finished_at"][-1] == 100.0
    assert numbers["staleness"] == {"0": 44, "1": 36} and numbers["max_staleness"] == 1
    assert numbers["response_tokens"] == 1000 and numbers["tokens_per_second"] == 9.9
    assert numbers["wall_seconds"] == 101.0


def test_run_numbers_of_a_short_run_average_what_there_is() -> None:
    steps = [{"mean_reward": 0.5, "finished_at": 1.0, "staleness": {"0": 2}, "response_tokens": 3}]
    numbers = run_numbers(PlannedRun("eta = 0", 0, Path("r"), True), steps, {})
    assert numbers["first_5"] == numbers["last_5"] == 0.5 and numbers["rise"] == 0
