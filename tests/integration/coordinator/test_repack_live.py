"""Repack in the live coordinator: a real manager, trajectory server and sim instances on loopback.

A whole job with ``migration: repack`` consolidates ramping-down instances and trains every group
within the bound; a repack whose source answers late moves nothing and loses nothing; an instance
that reports no KV utilisation is kept out with the reason."""

from __future__ import annotations

import asyncio
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from support import free_port, manager_and_trajectory_server, start_cli

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.instance import SnapshotOut
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config.strategy import MigrationMode, StrategyConfig, SyncMode
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.coordinator.service import Coordinator
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.strategies import CyclePlan, RepackMove, RouteDecision

ETA, BATCH, GROUP = 1, 2, 2
REPACK = StrategyConfig(migration=MigrationMode.REPACK, sync=SyncMode.LOAD_AWARE, repack_period_s=0.1, repack_batch=64)


def _train(manager: ManagerClient, ts: TrajectoryClient, steps: int, seconds: float, why: object) -> list:
    trained, deadline = [], time.monotonic() + seconds
    while len(trained) < steps:
        assert time.monotonic() < deadline, f"the job stalled after {len(trained)} steps: {why}"
        try:
            step = manager.consume()
        except ServiceError:
            time.sleep(0.02)  # a trainer polls for a Ready buffer
            continue
        assert step.version is not None
        batch = ts.batch(step.version)
        ts.free_batch(step.version)
        trained.append(batch)
    return trained


def test_a_job_with_repack_consolidates_and_trains_every_group_within_the_bound(tmp_path: Path) -> None:
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, tmp_path, 512, eta=ETA, batch_size=BATCH,
                                                            group_size=GROUP)
        instances = {}
        for name in ("a", "b", "c"):
            config = InstanceConfig(instance_id=name, completion_callback_url=TrajectoryClient.completed.url(ts_url),
                                    sim=SimConfig(workload="demo", clock="real", speed=10.0))
            instances[name] = stack.enter_context(serve_in_thread(instance_app(config))).url
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, strategy=REPACK, cycle_period=0.02,
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()]))))
        manager = stack.enter_context(ManagerClient(manager_url))
        ts = stack.enter_context(TrajectoryClient(ts_url))
        co = stack.enter_context(CoordinatorClient(coordinator.url))
        batches = []
        deadline = time.monotonic() + 120
        while not co.stats().command_count.get("repack") or len(batches) < 4:
            assert time.monotonic() < deadline, f"no repack in {len(batches)} steps: {co.stats()}"
            batches += _train(manager, ts, 1, 60, co.stats())
        for batch in batches:
            assert len(batch.trajectories) == BATCH * GROUP, "every group arrives whole"
            for t in batch.trajectories:
                assert t.v_traj is not None and t.v_traj <= batch.version <= t.v_traj + ETA, "staleness bound"
                assert sum(s.end - s.start for s in t.segments) == len(t.tokens) > 0
        repacks = [c for c in co.commands(limit=2000).commands if c.kind == "repack"]
        assert repacks and all(c.outcome == "ok" for c in repacks)
        assert all(i.snapshot and i.snapshot["kv_usage"] is not None for i in co.instances().instances)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["late", "dead"])
def test_a_repack_whose_source_answers_late_or_died_moves_nothing_and_loses_nothing(tmp_path: Path,
                                                                                    source: str) -> None:
    with ExitStack() as stack:
        manager_url, ts_url = manager_and_trajectory_server(stack, tmp_path, 512, eta=ETA, batch_size=BATCH,
                                                            group_size=GROUP)
        procs, urls = {}, {}
        for name in ("a", "b"):  # processes, so the source can be frozen for real (SIGSTOP)
            port = free_port()
            proc = start_cli("serve", "instance", "--engine", "sim", "--instance-id", name, "--port", str(port),
                             "--clock", "real", "--speed", "1", "--workload", "demo",
                             "--callback-url", TrajectoryClient.completed.url(ts_url), "--log-level", "warning")
            stack.callback(proc.wait, 10)
            stack.callback(proc.kill)
            stack.callback(proc.send_signal, signal.SIGCONT)
            procs[name], urls[name] = proc, f"http://127.0.0.1:{port}"
        manager = stack.enter_context(ManagerClient(manager_url))
        ts = stack.enter_context(TrajectoryClient(ts_url))
        asyncio.run(_silent_source(manager_url, ts_url, urls, procs, manager, ts, dies=source == "dead"))


async def _silent_source(manager_url: str, ts_url: str, urls: dict, procs: dict, manager: ManagerClient,
                         ts: TrajectoryClient, dies: bool) -> None:
    # the cycle waits 1 s for an interrupt's answer; a silent instance is declared failed after 30 s
    # (late: it answers before), or 3 s (dead: its work then goes back to pending and on to b)
    co = Coordinator(manager_url, ts_url, StrategyConfig(migration=MigrationMode.NONE), cycle_period=0.02,
                     command_timeout=1.0, failure_timeout=3.0 if dies else 30.0, stall_timeout=0.0,
                     reconcile_after=1.0)
    try:
        for name, url in urls.items():
            co.add_instance(name, url)
        deadline = time.monotonic() + 60
        held: list = []
        source = co.instances["a"]
        while not held:  # until the source runs work and no command to it is on its way
            assert time.monotonic() < deadline, "no trajectory ever reached instance a"
            await co.cycle()
            await asyncio.sleep(0.02)
            running = set(source.snapshot.run_trajs) if source.snapshot and not source.in_flight else set()
            held = [t for t in ts.routed(instance_id="a").trajectories if t.state == "routed" and t.traj_id in running]
        if dies:
            procs["a"].kill()
            procs["a"].wait()
        else:
            procs["a"].send_signal(signal.SIGSTOP)
        ids = [t.traj_id for t in held]
        plan = CyclePlan(interrupts={"a": ids}, repacks=[RepackMove("a", "b", tuple(ids))],
                         routes=[RouteDecision("b", t.traj_id, t.group_id, t.v_traj, False) for t in held])
        await co._issue(plan)
        # nothing moved: the trajectory server still has them on a, and b was sent none of them
        assert {t.traj_id for t in ts.routed(instance_id="a").trajectories} >= set(ids)
        assert not {t.traj_id for t in ts.routed(instance_id="b").trajectories} & set(ids)
        snap: SnapshotOut = await co.instances["b"].client.snapshot()
        assert not set(snap.run_trajs) & set(ids)
        entry = next(c for c in co.commands if c.kind == "repack")
        assert entry.instance_id == "a" and entry.outcome.startswith("unknown")
        if not dies:
            procs["a"].send_signal(signal.SIGCONT)  # it answers now, too late: the interrupt took them off it
        groups = {t.group_id for t in held}
        consumed: set[str] = set()
        deadline = time.monotonic() + 90
        while not groups <= consumed:  # every group of what was on a still reaches the trainer
            assert time.monotonic() < deadline, f"groups {groups - consumed} never trained: {co.stats}"
            await co.cycle()
            await asyncio.sleep(0.02)
            try:
                step = manager.consume()
            except ServiceError:
                continue
            assert step.version is not None
            consumed.update(step.group_ids)
            ts.free_batch(step.version)
    finally:
        await co.close()


def test_an_instance_without_kv_utilisation_is_kept_out_with_the_reason(tmp_path: Path) -> None:
    async def scenario() -> None:
        co = Coordinator("http://127.0.0.1:9", "http://127.0.0.1:9", REPACK, cycle_period=0.02, command_timeout=1.0,
                         failure_timeout=1.0, stall_timeout=0.0, reconcile_after=1.0)
        try:
            record = co.add_instance("old", "http://127.0.0.1:9")
            snap = SnapshotOut(instance_id="old", boot_id="x", seq=1, timestamp=0.0, engine_time=0.0, kv_cache=0,
                               run_trajs=[], wait_trajs=[], complete_trajs=[], inst_version=0, loading_weights=False)
            assert co._refuses(record, snap)
            assert "does not report" in (co.describe(record).refused or "")
            assert not co._refuses(record, snap.model_copy(update={"kv_usage": 0.0}))
            assert co.describe(record).refused is None
            plain = Coordinator("http://127.0.0.1:9", "http://127.0.0.1:9", StrategyConfig(), cycle_period=0.02,
                                command_timeout=1.0, failure_timeout=1.0, stall_timeout=0.0, reconcile_after=1.0)
            assert not plain._refuses(record, snap), "without repack nothing needs it"
            await plain.close()
        finally:
            await co.close()

    asyncio.run(scenario())
