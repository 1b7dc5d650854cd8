"""A Pull of a version nobody can serve any more (its only holder died after the parameter server
dropped its copy) is answered ``version_unavailable``; the coordinator then pulls the newest
version that exists. Real services: the parameter server as reference server, a holder, and a sim
instance whose engine pulls each version's bytes for real (``sim.pull_weights``: from the PS, or
from the holders where the PS dropped its copy)."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes as API
from staleflow.config.coordinator import CoordinatorSettings
from staleflow.config.strategy import StrategyConfig
from staleflow.coordinator.service import Coordinator
from staleflow.engines.sim import SimEngine
from staleflow.errors import ErrorCode
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.training.base import is_visible
from staleflow.transports.client import ParamsClient


def wait_until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s:g} s"
        time.sleep(0.05)  # polling pace
    return value


def test_a_pull_of_a_version_nobody_holds_is_rerouted_to_one_that_exists(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ps = stack.enter_context(serve_in_thread(params_app(ParamsConfig(
            state_dir=tmp_path / "ps", port=0, persist=False, chunk_bytes=1 << 16, retain_replicas=1, holder_ttl_s=1.0))))
        holder = serve_in_thread(params_app(ParamsConfig(
            state_dir=tmp_path / "holder", port=0, persist=False, holder_of=ps.url, holder_id="only", holder_follows=False,
            keep=1, holder_ttl_s=1.0)))
        client = stack.enter_context(ParamsClient(ps.url))
        client.push(0, {"w": np.arange(50_000, dtype=np.float32)})
        client.push(1, {"w": np.arange(50_000, dtype=np.float32) + 1})
        with ParamsClient(holder.url, timeout=60) as on_holder:
            on_holder.json(API.holder_pull, "1")
        wait_until(lambda: client.json(API.references)["ps_copies"] == [0], "the PS to drop its copy of version 1")
        state = client.versions()  # what a trainer reads to see whether its last push is still there
        assert state.latest == 1 and state.referenced == [1] and is_visible(state, 1), \
            "a version the PS dropped its copy of for its holder is still visible: the trainer must not push it again"
        with pytest.raises(ServiceError) as pushed_again:
            client.push(1, {"w": np.arange(50_000, dtype=np.float32) + 1})
        assert pushed_again.value.code is ErrorCode.VERSION_EXISTS, "its holder serves it: versions are immutable"
        holder.stop()  # its only holder dies: nobody can serve version 1 once its record lapses
        wait_until(lambda: client.json(API.references)["available"] == [0], "version 1 to become unavailable")
        assert client.latest().version == 1, "still the newest version the reference server knows of"

        engine = SimEngine(instance_id="inst", clock="real", pull_weights=True)
        instance = stack.enter_context(serve_in_thread(instance_app(InstanceConfig(
            instance_id="inst", sim=SimConfig(clock="real")), engine))).url
        settings = CoordinatorSettings()
        pulls_before = _pulls_started(ps.url)
        asyncio.run(_join_and_pull(ps.url, instance, settings, engine))
        assert engine.core.version == 0
        assert _pulls_started(ps.url) == pulls_before + 1, "the engine pulled version 0's bytes from the PS"


def _pulls_started(url: str) -> int:
    """Pulls the parameter server started (its /metrics), over every transport."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("staleflow_params_pulls_total"))


async def _join_and_pull(ps_url: str, instance_url: str, settings: CoordinatorSettings, engine: SimEngine) -> None:
    """An instance joins (elastically) and is told to pull the newest version, 1: refused with
    version_unavailable, the coordinator pulls version 0 instead (its command worker runs it)."""
    unused = "http://127.0.0.1:9"  # the manager and the trajectory server take no part in a Pull
    coordinator = Coordinator(unused, unused, StrategyConfig(), params_url=ps_url, cycle_period=settings.cycle_period,
                              command_timeout=settings.command_timeout, failure_timeout=settings.failure_timeout,
                              stall_timeout=settings.stall_timeout, reconcile_after=settings.reconcile_after)
    try:
        record = coordinator.add_instance("inst", instance_url)
        coordinator.ps_version = await coordinator._ps_version()
        assert coordinator.ps_version == 1
        reply = await coordinator._command(record, coordinator._pull(record))
        assert reply is None and "version_unavailable" in coordinator.commands[-1].outcome
        assert coordinator.stats.rerouted_pulls == 1 and coordinator._pull_target() == 0
        deadline = time.monotonic() + 60
        while engine.core.version != 0 or record.in_flight:
            assert time.monotonic() < deadline, "the rerouted pull did not run"
            await asyncio.sleep(0.05)  # polling pace
        assert coordinator.commands[-1].kind == "pull" and coordinator.commands[-1].outcome == "ok"
    finally:
        await coordinator.close()


def test_a_deleted_version_leaves_the_retained_versions(tmp_path: Path) -> None:
    """A version withdrawn from the PS (``DELETE /v1/params/{v}``) no longer counts among the
    ``retain`` newest: an older one stays retained (available) instead of being let go for it."""
    with serve_in_thread(params_app(ParamsConfig(state_dir=tmp_path / "ps", port=0, persist=False, keep=2,
                                                 chunk_bytes=1 << 16))) as ps, ParamsClient(ps.url) as client:
        for version in range(3):
            client.push(version, {"w": np.full(1000, version, np.float32)})
        assert client.json(API.references)["retained"] == [1, 2]
        client.delete_version(2)
        assert client.json(API.references)["retained"] == [1], "the deleted version 2 left the window"
        client.push(3, {"w": np.full(1000, 3, np.float32)})
        assert client.json(API.references)["retained"] == [1, 3]
