"""Pulls that keep the trajectories (in-flight weight updates) in a whole job: a real manager,
trajectory server, coordinator and sim instances on loopback. The coordinator syncs greedily and
never migrates, so whatever runs when a version appears goes on through the Pull: nothing is
ever interrupted, trajectories carry tokens of several versions, every one within the bound, and
the coordinator's speculative state keeps matching the instances (a mismatch would leave an
instance unplanned for ``reconcile_after``, set far beyond the job)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from support import manager_and_trajectory_server

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config.strategy import MigrationMode, PullMode, StrategyConfig, SyncMode
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app

ETA, BATCH, GROUP, STEPS = 1, 2, 2, 6


def test_a_job_whose_pulls_keep_the_trajectories_trains_them_across_versions(tmp_path: Path) -> None:
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, tmp_path, 512, eta=ETA, batch_size=BATCH,
                                                            group_size=GROUP)
        instances = {}
        for name in ("a", "b"):
            config = InstanceConfig(instance_id=name, completion_callback_url=TrajectoryClient.completed.url(ts_url),
                                    sim=SimConfig(workload="demo", clock="real", speed=10.0))
            instances[name] = stack.enter_context(serve_in_thread(instance_app(config))).url
        strategy = StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE, pull=PullMode.KEEP)
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, strategy=strategy, cycle_period=0.02, reconcile_after=600.0,
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()]))))
        manager = stack.enter_context(ManagerClient(manager_url))
        ts = stack.enter_context(TrajectoryClient(ts_url))
        co = stack.enter_context(CoordinatorClient(coordinator.url))

        trained = []
        deadline = time.monotonic() + 120
        while len(trained) < STEPS * BATCH * GROUP:
            assert time.monotonic() < deadline, f"the job stalled: {co.stats()}"
            try:
                step = manager.consume()
            except ServiceError:
                time.sleep(0.02)  # a trainer polls for a Ready buffer
                continue
            assert step.version is not None
            batch = ts.batch(step.version)
            ts.free_batch(step.version)
            trained += [(step.version, t) for t in batch.trajectories]

        across = 0
        for version, t in trained:
            assert t.v_traj is not None and t.v_traj <= version <= t.v_traj + ETA, "staleness bound"
            versions = [s.version for s in t.segments]
            assert versions == sorted(versions) and versions[0] >= t.v_traj, "V_traj is the oldest version"
            assert sum(s.end - s.start for s in t.segments) == len(t.tokens) > 0
            across += len(set(versions)) > 1
        stats = co.stats()
        assert stats.pulls > len(instances), "no Pull beyond the instances' first"
        assert stats.interrupted == 0, "a Pull that keeps the trajectories interrupted some"
        assert across > 0, "no trained trajectory went on through a Pull"
        assert stats.accepted_snapshots > 0 and stats.reconciled == 0
        # once the rest of the admitted work is done, every instance matches the speculative state
        deadline = time.monotonic() + 60
        while not all(i.validated for i in co.instances().instances):
            assert time.monotonic() < deadline, co.instances()
            time.sleep(0.05)  # polling the coordinator's view
