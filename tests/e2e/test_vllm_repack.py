"""Laminar's repack on two real vLLM (CPU build) engines: the strategy reads their snapshots, the
plan moves one instance's long trajectory onto the other, and the freed one Pulls the newer version.

Driven through the engine interface and ``plan_cycle``, the coordinator's decision pass, executed
as the coordinator executes a plan: the Interrupts, then the Pulls, then the Routes. Skipped where
vLLM is not installed (setup: tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from test_vllm_engine import PROMPT, build_tiny_qwen2, reference_greedy  # sets vLLM's offline environment

from staleflow.config.engines import VllmEngineParams
from staleflow.config.strategy import MigrationMode, StrategyConfig
from staleflow.engines.base import (
    CompletedTrajectory,
    EngineSnapshot,
    FinishReason,
    SamplingParams,
    Segment,
    TrajectoryRequest,
    WeightsPath,
)
from staleflow.engines.vllm_engine import VllmEngine
from staleflow.strategies import KvReadings, plan_cycle
from staleflow.strategies.state import InstanceState, PendingTrajectory

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.torch, pytest.mark.timeout(600)]

LONG = 480  # response tokens of each instance's long trajectory: it outlives the short ones by far
SHORT = 96
LONG_PROMPTS = {"a": PROMPT, "b": tuple(reversed(PROMPT))}
REPACK = StrategyConfig(migration=MigrationMode.REPACK, repack_batch=8)


def _request(traj_id: str, prompt: tuple[int, ...], max_tokens: int, v_traj: int = 0) -> TrajectoryRequest:
    return TrajectoryRequest(traj_id=traj_id, group_id=traj_id.split("/")[0], prompt_ids=prompt, v_traj=v_traj,
                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _short_prompt(k: int) -> tuple[int, ...]:
    """A distinct prompt spanning many KV blocks, so that its blocks are its own (no prefix sharing)."""
    return tuple(3 + (k * 131 + i * 7) % 480 for i in range(240))


class Instances:
    """Two vLLM engines on one event loop, on the same weights (version 0)."""

    def __init__(self, model: Path):
        self.loop = asyncio.new_event_loop()
        self.engines: dict[str, VllmEngine] = {}
        self.streams: dict[str, AsyncIterator[CompletedTrajectory]] = {}
        for name in ("a", "b"):
            engine = VllmEngine(VllmEngineParams(model=str(model), dtype="float32", max_model_len=1024))
            self.run(engine.start())
            self.engines[name], self.streams[name] = engine, engine.completions()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def snapshot(self, name: str) -> EngineSnapshot:
        return self.run(self.engines[name].snapshot())

    def next_completed(self, name: str) -> CompletedTrajectory:
        return self.run(asyncio.wait_for(anext(self.streams[name]), 120))

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        """Bounded polling of a real condition, letting the engines' loop run in between."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"{what}: not reached in time"
            self.run(asyncio.sleep(0.002))

    def close(self) -> None:
        for engine in self.engines.values():
            self.run(engine.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    build_tiny_qwen2(root / "v0", seed=0)
    build_tiny_qwen2(root / "v1", seed=1)
    return root / "v0", root / "v1"


@pytest.fixture(scope="module")
def instances(models: tuple[Path, Path]) -> Iterator[Instances]:
    pair = Instances(models[0])
    yield pair
    pair.close()


def _state(name: str, snap: EngineSnapshot) -> InstanceState:
    """The instance as the coordinator hands it to the strategies (its snapshot's fields)."""
    return InstanceState(name, snap.inst_version, float(snap.kv_cache), list(snap.run_trajs), list(snap.wait_trajs),
                         kv_usage=snap.kv_usage)


def test_repack_consolidates_two_long_tails_onto_one_instance_and_the_freed_one_pulls_the_newer_version(
        instances: Instances, models: tuple[Path, Path]) -> None:
    # the reference: each long trajectory generated in one go, never interrupted (greedy)
    instances.run(instances.engines["a"].route([_request(f"ref{n}/0", p, LONG) for n, p in LONG_PROMPTS.items()]))
    reference = {}
    for _ in LONG_PROMPTS:
        done = instances.next_completed("a")
        reference[done.traj_id.removeprefix("ref").split("/")[0]] = done.tokens
    fresh_on_v1 = reference_greedy(models[1], PROMPT, 16)

    # each instance: a long trajectory and three short ones; its KV use peaks while all four run
    # (one instance after the other: the peak is read before its short ones can finish)
    longs = {name: f"{name}-long/0" for name in instances.engines}
    readings = KvReadings()
    for k, (name, engine) in enumerate(instances.engines.items()):
        shorts = [_request(f"{name}-short{j}/0", _short_prompt(4 * k + j), SHORT) for j in range(3)]
        instances.run(engine.route([_request(longs[name], LONG_PROMPTS[name], LONG), *shorts]))
        instances.wait_until(lambda e=engine: len(instances.run(e.snapshot()).run_trajs) == 4
                             and all(e.generated(t) >= 1 for t in instances.run(e.snapshot()).run_trajs),
                             f"{name} runs all four")
        readings.record([_state(name, instances.snapshot(name))])
    peak = readings.previous()
    assert all(0 < usage < REPACK.repack_kv_share for usage in peak.values()), peak

    # the short ones finish: each instance ramps down to its one long trajectory
    for name in instances.engines:
        finished = {instances.next_completed(name).traj_id for _ in range(3)}
        assert finished == {f"{name}-short{j}/0" for j in range(3)}
        instances.wait_until(lambda n=name: (instances.snapshot(n).kv_usage or 0.0) < peak[n], f"{name} ramps down")
    snaps = {name: instances.snapshot(name) for name in instances.engines}
    assert all(s.run_trajs + s.wait_trajs == (longs[n],) for n, s in snaps.items()), snaps

    # the trainer published version 1; the repack check plans one move within the version group
    on_instances = {t: PendingTrajectory(t, t.split("/")[0], 0, len(LONG_PROMPTS[n]) + (snaps[n].generated or {})[t])
                    for n, t in longs.items()}
    plan = plan_cycle([_state(n, s) for n, s in snaps.items()], [], 1, {}, REPACK, on_instances=on_instances,
                      repack_previous=peak)
    (move,) = plan.repacks
    source, destination = move.source, move.destination
    assert move.trajectories == (longs[source],) and {source, destination} == {"a", "b"}
    assert plan.interrupts == {source: [longs[source]]} and plan.syncs == [source]
    assert [(r.instance_id, r.traj_id, r.v_traj) for r in plan.routes] == [(destination, longs[source], 0)]

    # executed as the coordinator does: the Interrupt, the freed source's Pull, the Route
    result = instances.run(instances.engines[source].interrupt([longs[source]]))
    (partial,) = result.partials
    assert 0 < len(partial.tokens) < LONG and partial.tokens == reference[source][: len(partial.tokens)]
    assert instances.run(instances.engines[source].load_weights(WeightsPath(version=1, path=str(models[1])))) == []
    instances.run(instances.engines[destination].route([partial.to_request()]))

    # one busy instance holds both tails; the freed one is on version 1 and empty
    instances.wait_until(lambda: set(instances.snapshot(destination).run_trajs) == set(longs.values()),
                         "the destination runs both long trajectories")
    freed = instances.snapshot(source)
    assert freed.inst_version == 1 and freed.run_trajs == freed.wait_trajs == ()
    assert instances.snapshot(destination).inst_version == 0

    # both tails finish on the destination with the tokens of an uninterrupted run, all on version 0
    done = {}
    for _ in range(2):
        completed = instances.next_completed(destination)
        done[completed.traj_id] = completed
    for name, traj_id in longs.items():
        assert done[traj_id].finish_reason is FinishReason.LENGTH
        assert done[traj_id].tokens == reference[name], f"{name}'s long trajectory"
        assert done[traj_id].segments == (Segment(0, 0, LONG),)
        assert len(done[traj_id].logprobs) == LONG

    # the freed instance generates new work on the newer weights at once
    instances.run(instances.engines[source].route([_request("new/0", PROMPT, 16, v_traj=1)]))
    fresh = instances.next_completed(source)
    assert list(fresh.tokens) == fresh_on_v1 and fresh.segments == (Segment(1, 0, 16),)
