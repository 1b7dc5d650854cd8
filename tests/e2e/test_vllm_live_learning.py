"""The live coordinator learns lengths and speeds from real vLLM (CPU build) engines.

A real manager, trajectory server, parameter server and coordinator on loopback, two instance
servers on vLLM with a tiny random Qwen2, and a trainer that consumes each buffer and pushes the
next version (the same weights) to the parameter server. The coordinator routes length-aware
with ``pull: auto`` and global syncs: every finished length reaches its predictor once, and the
``pull: auto`` choices it records were made from the engines' own decode counters (a decode speed
measured from them, not the as-modelled 1.0). Assertions read the coordinator's recorded inputs,
never timings. Skipped where vLLM is not installed (setup: tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
from support import manager_config
from test_vllm_engine import build_tiny_qwen2, safetensors_torch  # sets vLLM's offline environment

from staleflow.api.base import ServiceError
from staleflow.api.coordinator import CoordinatorClient, LearningOut
from staleflow.api.manager import ManagerClient
from staleflow.api.trajectories import TrajectoryClient
from staleflow.config import LedgerConfig
from staleflow.config.strategy import MigrationMode, PullMode, StrategyConfig, SyncMode
from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app
from staleflow.transports.client import ParamsClient

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.torch, pytest.mark.timeout(600)]

ETA, BATCH, GROUP, MAX_TOKENS = 1, 2, 2, 48
# a global sync Pulls once every instance is planned (none busy with a command), so each choice
# weighs an instance against its peer: with one planned instance pull: auto keeps whatever runs
LEARNING = StrategyConfig(sync=SyncMode.GLOBAL, migration=MigrationMode.NONE, pull=PullMode.AUTO, length_aware=True)


def wait_for(predicate: Callable[[], bool], what: Callable[[], object], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in time: {what()}"
        time.sleep(0.05)  # poll pacing


def _train(manager_url: str, ts_url: str, params_url: str, state: dict, trained: list[int],
           stop: threading.Event) -> None:
    """Consume each buffer, free it, push the next version (what a trainer does, minus the step),
    until told to stop."""
    with ManagerClient(manager_url) as manager, TrajectoryClient(ts_url) as ts, ParamsClient(params_url) as params:
        while not stop.is_set():
            try:
                step = manager.consume()
            except ServiceError:
                time.sleep(0.05)  # a trainer polls for a Ready buffer
                continue
            assert step.version is not None
            ts.free_batch(step.version)
            params.push(step.version + 1, state)
            trained.append(step.version)


def test_the_coordinator_learns_lengths_and_decides_pulls_from_vllms_decode_counters(tmp_path: Path) -> None:
    model = tmp_path / "model"
    build_tiny_qwen2(model, seed=0)
    state = safetensors_torch.load_file(str(model / "model.safetensors"))
    with ExitStack() as stack:
        ledger = {"eta": ETA, "batch_size": BATCH, "group_size": GROUP}
        manager_url = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **ledger)))).url
        ts_url = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
            ledger=LedgerConfig(**ledger), manager_url=manager_url, state_dir=tmp_path, reward="sim",
            sampling=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0))))).url
        params_url = stack.enter_context(serve_in_thread(params_app(ParamsConfig(
            state_dir=tmp_path / "params", port=0, fsync=False, keep=4, transports=("http", "shm"))))).url
        instances = {}
        for name in ("a", "b"):
            config = InstanceConfig(instance_id=name, engine="vllm", completion_callback_url=TrajectoryClient.completed.url(ts_url),
                                    vllm={"model": str(model), "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1})
            instances[name] = stack.enter_context(serve_in_thread(instance_app(config), startup_timeout=240)).url
        coordinator = stack.enter_context(serve_in_thread(coordinator_app(CoordinatorConfig(
            manager_url=manager_url, ts_url=ts_url, params_url=params_url, strategy=LEARNING, cycle_period=0.02,
            instances=[InstanceEndpoint(instance_id=n, url=url) for n, url in instances.items()]))))
        co = stack.enter_context(CoordinatorClient(coordinator.url))
        ts = stack.enter_context(TrajectoryClient(ts_url))
        manager = stack.enter_context(ManagerClient(manager_url))

        trained: list[int] = []
        stop = threading.Event()
        trainer = threading.Thread(target=_train, args=(manager_url, ts_url, params_url, state, trained, stop), daemon=True)
        trainer.start()
        stack.callback(trainer.join, 30)
        stack.callback(stop.set)

        def learned() -> LearningOut:
            return co.learning()

        def weighed(learning: LearningOut) -> list:
            """Choices that weighed a syncing instance's running work against a peer (a lone
            planned instance keeps its work whatever its speed)."""
            return [d for d in learning.pull_decisions if d.inputs[d.instance_id].running and len(d.inputs) > 1]

        def decided() -> bool:
            return bool(weighed(learned()))

        wait_for(decided, lambda: (trained, learned(), co.stats()))
        stop.set()

        def caught_up() -> bool:  # the trainer stopped: the bound lets nothing new start, what runs finishes
            waiting = [t for t in ts.pending().trajectories if t.v_traj is not None]
            drained = not (any(manager.admission().by_version().values()) or ts.routed().trajectories or waiting)
            lengths = learned().lengths
            return drained and lengths is not None and lengths.cursor == ts.finished_lengths(after=0, limit=10_000).next

        wait_for(caught_up, learned)
        feed = ts.finished_lengths(after=0, limit=10_000)
        learning = learned()
        lengths = learning.lengths
        assert lengths is not None and feed.skipped == 0
        assert lengths.observed == len(feed.lengths) >= len(trained) * BATCH * GROUP > 0, "each finished length once"
        assert 1 <= min(f.length for f in feed.lengths) and max(f.length for f in feed.lengths) <= MAX_TOKENS
        assert lengths.typical_length <= MAX_TOKENS, "the predictor learned the engines' lengths, not its prior"

        # pull: auto decided from vLLM's own decode counters: every planned instance reported them,
        # and the speed they gave (the tiny model on a CPU against the default cost model) is measured
        with_work = weighed(learning)
        assert with_work, "a Pull while its instance ran trajectories, weighed against its peer"
        for d in with_work:
            assert set(d.inputs) == set(instances)
            assert all(i.decode_steps and i.decode_seconds and i.decode_seconds > 0 for i in d.inputs.values())
        assert any(i.speed != 1.0 for d in with_work for i in d.inputs.values()), "a speed measured from the counters"
        assert all(learning.speeds[n] != 1.0 for n in instances), learning.speeds
        kept = {d.kept for d in with_work}
        pulls = [c for c in co.commands(limit=2000).commands if c.kind == "pull"]
        assert pulls and all(c.outcome == "ok" for c in pulls), pulls
        print(f"\n{len(feed.lengths)} lengths, typical {lengths.typical_length:.1f}; {len(with_work)} pull: auto "
              f"choices with work (kept: {sorted(kept)}); speeds {learning.speeds}")
