"""Chaos over real processes: a parameter server and three following holders; versions pushed one
after the other while holders and the parameter server are SIGKILLed and restarted in turn. Every
pull from the holders is byte-exact, and after each version the newest version that exists can be
pulled (the one pushed, or where every copy of it died, the newest the reference server lists)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support import ParamsProcess

from staleflow.api.base import ServiceError
from staleflow.api.params import ParamsRoutes as API
from staleflow.errors import ErrorCode
from staleflow.transports.client import ParamsClient


def weights(version: int) -> dict[str, np.ndarray]:
    return {"w": (np.arange(200_000, dtype=np.float32) * (version + 1)), "b": np.full(333, version, np.int32)}


def retry(call, timeout_s: float = 60.0):
    """``call()`` until it answers: the parameter server may be restarting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except (OSError, ServiceError) as exc:
            if isinstance(exc, ServiceError) and not exc.transient:
                raise
            assert time.monotonic() < deadline, f"no answer in {timeout_s:g} s: {exc}"
            time.sleep(0.1)  # polling pace while it restarts


@pytest.mark.slow  # five processes, killed and restarted for a few minutes
@pytest.mark.timeout(480)
def test_holders_and_the_ps_killed_in_turn_never_cost_a_corrupt_byte(tmp_path: Path) -> None:
    ps = ParamsProcess(tmp_path / "ps", "--chunk-mb", "0.0625", "--holder-ttl", "2", "--retain-replicas", "2", "--keep", "2")
    holders = [ParamsProcess(tmp_path / f"h{i}", "--holder-of", ps.url, "--holder-id", f"h{i}", "--keep", "1",
                             "--holder-ttl", "2") for i in range(3)]
    rerouted = 0
    try:
        ps.start(persist=True)
        for h in holders:
            h.start(persist=False)
        with ParamsClient(ps.url, timeout=30) as client:
            for version in range(10):
                retry(lambda v=version: client.push(v, weights(v)))
                if version % 3 == 1:
                    victim = holders[version % len(holders)]
                    victim.kill()
                    victim.start(persist=False)
                elif version % 3 == 2:
                    ps.kill()
                    ps.start(persist=True)
                rerouted += _pull_newest(client, version)
    finally:
        for h in holders:
            h.stop()
        ps.stop()
    assert rerouted <= 4, "most versions survive the kills"


def _pull_newest(client: ParamsClient, version: int) -> int:
    """Pull ``version`` from the holders once they follow it, byte-exact; where nobody can serve it
    any more (after 15 s of trying), the newest version the reference server lists instead. 1
    when it had to reroute. A refusal while holders and the PS come back is tried again."""
    started = time.monotonic()
    while True:
        target = version
        try:
            if time.monotonic() - started > 15:
                available = client.json(API.references)["available"]
                target = max(available) if available and version not in available else version
            pulled = client.pull(target, sources="ros")
        except (OSError, ServiceError) as exc:
            code = getattr(exc, "code", None)
            assert code in (None, ErrorCode.VERSION_UNAVAILABLE, ErrorCode.UNKNOWN_VERSION), exc
            assert time.monotonic() - started < 90, f"version {version}: nothing pullable in 90 s: {exc}"
            time.sleep(0.1)  # polling pace: the PS restarting, the holders following
            continue
        assert _same(pulled, weights(target)), f"version {target} pulled other bytes"
        return int(target != version)


def _same(pulled: dict, pushed: dict) -> bool:
    return set(pulled) == set(pushed) and all(pulled[k].tobytes() == v.tobytes() for k, v in pushed.items())
