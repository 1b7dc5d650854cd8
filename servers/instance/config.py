"""``create_engine``, which builds the engine an ``InstanceConfig`` describes; the settings live
with the others (``staleflow.config.instance``)."""

from __future__ import annotations

from staleflow.config.instance import ID_PATTERN, InstanceConfig, SimConfig, VllmConfig
from staleflow.engines.base import RolloutEngine
from staleflow.engines.sim import SimEngine

__all__ = ["ID_PATTERN", "InstanceConfig", "SimConfig", "VllmConfig", "create_engine"]


def create_engine(config: InstanceConfig) -> RolloutEngine:
    if config.engine == "sim":
        sim = config.sim
        return SimEngine(sim.params(), instance_id=config.instance_id, clock=sim.clock, speed=sim.speed)
    from staleflow.config.engines import VllmEngineParams
    from staleflow.engines.vllm_engine import VllmEngine

    assert config.vllm is not None
    params = VllmEngineParams(**config.vllm.model_dump())
    return VllmEngine(params)
