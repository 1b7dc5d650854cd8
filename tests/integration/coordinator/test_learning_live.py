"""The live coordinator learns as a job runs: a real manager, trajectory server, coordinator and
sim instances on loopback, routing length-aware with ``pull: auto`` and adaptive redundancy (a
ledger with an extra group per buffer).

Every finished length reaches the coordinator's predictor exactly once, across a restart of the
trajectory server and of the coordinator itself; each ``pull: auto`` choice is kept with the decode
counters and speeds it was made from."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from support import free_port, manager_config

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient, LearningOut
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import LedgerConfig
from staleflow.config.strategy import MigrationMode, PullMode, StrategyConfig, SyncMode
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

ETA, BATCH, GROUP, STEPS = 1, 2, 2, 2
LEARNING = StrategyConfig(sync=SyncMode.GREEDY, migration=MigrationMode.NONE, pull=PullMode.AUTO, length_aware=True,
                          adaptive_redundancy=True)


def wait_for(predicate: Callable[[], bool], what: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in time: {what()}"
        time.sleep(0.02)  # poll pacing


class Restartable:
    """A server on a fixed port that can be stopped and started again."""

    def __init__(self, stack: ExitStack, make_app: Callable[[], object]):
        self.make_app, self.port = make_app, free_port()
        self.inner = ExitStack()
        stack.callback(lambda: self.inner.close())
        self.url = self.start()

    def start(self) -> str:
        return self.inner.enter_context(serve_in_thread(self.make_app(), port=self.port)).url

    def restart(self) -> None:
        self.inner.close()
        self.inner = ExitStack()
        self.start()


def test_finished_lengths_and_decode_counters_reach_the_coordinator_once_across_restarts(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ledger = {"eta": ETA, "batch_size": BATCH, "group_size": GROUP, "batch_redundancy": 0.5}
        manager_url = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **ledger)))).url
        ts_server = Restartable(stack, lambda: ts_app(TrajectoryServerConfig(
            ledger=LedgerConfig(**ledger), manager_url=manager_url, state_dir=tmp_path, reward="sim",
            sampling=SamplingConfig(max_tokens=512))))
        instances = {}
        for name in ("a", "b"):
            config = InstanceConfig(instance_id=name, completion_callback_url=TrajectoryClient.completed.url(ts_server.url),
                                    sim=SimConfig(workload="demo", clock="real", speed=10.0))
            instances[name] = stack.enter_context(serve_in_thread(instance_app(config))).url
        coordinator = Restartable(stack, lambda: coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_server.url, strategy=LEARNING, cycle_period=0.02,
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()])))
        manager = stack.enter_context(ManagerClient(manager_url))
        ts = stack.enter_context(TrajectoryClient(ts_server.url))
        co = stack.enter_context(CoordinatorClient(coordinator.url))

        trained = 0
        deadline = time.monotonic() + 120
        while trained < STEPS:
            assert time.monotonic() < deadline, f"the job stalled after {trained} steps: {co.stats()}"
            try:
                step = manager.consume()
            except ServiceError:
                time.sleep(0.02)  # a trainer polls for a Ready buffer
                continue
            assert step.version is not None
            ts.free_batch(step.version)
            trained += 1

        # the trainer stops: the bound lets nothing new start, what runs finishes, then nothing more does
        def newest() -> int:
            return ts.finished_lengths(after=0, limit=10_000).next

        def learned() -> LearningOut:
            return co.learning()

        def caught_up() -> bool:
            lengths = learned().lengths
            waiting = [t for t in ts.pending().trajectories if t.v_traj is not None]  # members of started groups
            drained = not (any(manager.admission().by_version().values()) or ts.routed().trajectories or waiting)
            return drained and lengths is not None and lengths.cursor == newest()

        wait_for(caught_up, learned)
        feed = ts.finished_lengths(after=0, limit=10_000)
        before = learned()
        assert before.lengths is not None and feed.skipped == 0
        assert before.lengths.observed == len(feed.lengths) >= STEPS * BATCH * GROUP, "each finished length once"
        assert before.lengths.epoch == feed.epoch and before.lengths.typical_length != 1024.0, "learned, not the prior"
        assert before.lengths.tail is not None, "adaptive redundancy predicted the tail"
        decisions = before.pull_decisions
        assert decisions, "greedy syncs under pull: auto"
        for d in decisions:
            assert set(d.inputs) == set(instances)
            assert all(i.decode_steps is not None and i.decode_seconds is not None for i in d.inputs.values())
        assert any(i.decode_steps for d in decisions for i in d.inputs.values()), "the engines' decode counters"

        ts_server.restart()
        cycles = co.stats().cycles
        wait_for(lambda: co.stats().cycles > cycles + 20, co.stats)  # cycles that read the restarted server
        after = learned().lengths
        assert after is not None and after.epoch == before.lengths.epoch
        assert (after.cursor, after.observed) == (before.lengths.cursor, before.lengths.observed), \
            "a restarted trajectory server's feed goes on where it was"

        coordinator.restart()
        wait_for(caught_up, learned)
        fresh = learned().lengths
        assert fresh is not None and fresh.observed == len(feed.lengths), "a restarted coordinator relearns it all, once"
        assert fresh.typical_length == before.lengths.typical_length
