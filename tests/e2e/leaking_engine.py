"""A simulated engine that leaks on purpose: it keeps 1 MiB of garbage for every trajectory it
completes. Named by ``STALEFLOW_TEST_ENGINE_FACTORY=leaking_engine:build`` (with this directory on
``PYTHONPATH``), it is what the memory soak must catch."""

from __future__ import annotations

from staleflow.config import InstanceConfig
from staleflow.engines.base import CompletedTrajectory
from staleflow.engines.sim import SimEngine

LEAK_BYTES = 1 << 20


class LeakingSimEngine(SimEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: list[bytearray] = []

    def _deliver(self) -> None:
        for finished in self.core.pop_finished():
            trajectory: CompletedTrajectory = finished.trajectory()
            self.kept.append(bytearray(b"x" * LEAK_BYTES))  # written, so the pages are resident
            self._stream.put(trajectory)


def build(config: InstanceConfig) -> LeakingSimEngine:
    sim = config.sim
    return LeakingSimEngine(sim.params(), instance_id=config.instance_id, clock=sim.clock, speed=sim.speed)
