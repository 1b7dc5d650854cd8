"""Load-aware sync with Pulls that keep the trajectories: a busy lagging instance Pulls at once.

Held back until its load fell, a lagging instance kept taking new groups at its old version, so a
fleet that started at version 0 stayed there until all ``(eta + 1) x B`` of version 0's
admissions were spent; the first buffer that needed a newer version then waited for groups that
all started at that moment, and throughput dipped at the eta where that happened inside the job
(paper-20k and paper-40k, 32 instances, 5 steps: eta = 3 below eta = 2 and 4)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from staleflow.config.strategy import MigrationMode, PullMode, StrategyConfig, SyncMode
from staleflow.cost_model import CostModel
from staleflow.simulation import resolve, scenario
from staleflow.simulation.experiment import Point, SimulatedJob, run_job
from staleflow.strategies import InstanceState, PendingTrajectory, plan_cycle

COST = CostModel(kv_budget=100_000)
LOAD_AWARE = StrategyConfig(sync=SyncMode.LOAD_AWARE, migration=MigrationMode.NONE, route_by_speed=False)


def busy(name: str, running: int = 4) -> InstanceState:
    """``running`` trajectories in 20 % of the KV budget each: above load-aware sync's threshold from 3 on."""
    return InstanceState(name, 0, 20_000.0 * running, [f"{name}-r{i}" for i in range(running)], [], COST, 1.0)


@pytest.mark.parametrize("pull", [PullMode.AUTO, PullMode.KEEP])
def test_a_busy_lagging_instance_pulls_when_its_pull_keeps_the_work(pull: PullMode) -> None:
    fleet = [busy("a", running=4), busy("b", running=3), busy("c", running=4)]
    on_instances = {t: PendingTrajectory(t, "g", 0, 20_000) for i in fleet for t in i.running}
    # a trajectory of version 0 waits as well: load-aware sync alone holds every Pull back
    waiting = [PendingTrajectory("w", "g2", 0, 100)]
    config = replace(LOAD_AWARE, pull=pull)
    plan = plan_cycle(fleet, waiting, ps_version=1, admission={0: 4, 1: 4}, config=config, on_instances=on_instances)
    assert plan.syncs == ["b"] and plan.kept == ["b"], "one a cycle: the least loaded, whose Pull stalls the least"
    assert not plan.interrupts, "nothing is handed back: the Pull keeps the trajectories and their KV"
    # the next cycle (b loading its weights is not in the snapshots) takes the next one
    after = plan_cycle([fleet[0], fleet[2]], waiting, ps_version=1, admission={0: 4, 1: 4}, config=config,
                       on_instances=on_instances)
    assert after.syncs == ["a"] and after.kept == ["a"]


def test_a_pull_that_interrupts_still_waits_for_a_low_load() -> None:
    fleet = [busy("a"), busy("b")]
    plan = plan_cycle(fleet, [PendingTrajectory("w", "g2", 0, 100)], ps_version=1, admission={0: 4, 1: 4},
                      config=replace(LOAD_AWARE, pull=PullMode.INTERRUPT))
    assert plan.syncs == [] and plan.kept == []


def test_new_groups_start_at_a_newer_version_before_the_first_versions_admissions_run_out() -> None:
    """A paper-20k job at a twelfth of its size, eta = 3: the first eta + 1 buffers could all be
    filled with groups of version 0. Before, the fleet stayed at version 0 until they were, and
    every trajectory of those buffers carried V_traj 0; now groups admitted after version 1 is
    published start at it."""
    base = scenario("paper-20k")
    job = replace(base, workload=replace(base.workload, batch_size=16, group_size=8))
    eta = 3
    result = run_job(SimulatedJob(Point(0, eta, job), resolve("sf-rsm")[0], instances=4, steps=eta + 1))
    assert result.violations == 0
    later = sum(n for buffer, staleness in result.staleness.items() for s, n in staleness.items() if s < buffer)
    assert later > 0, f"every trajectory of buffers 0..{eta} started at version 0: {result.staleness}"
