"""``create_engine``: the rollout engine an instance's settings (``InstanceConfig``) describe. vLLM
is imported only when the settings ask for it."""

from __future__ import annotations

from staleflow.config.instance import InstanceConfig
from staleflow.engines.base import RolloutEngine
from staleflow.engines.sim import SimEngine


def create_engine(config: InstanceConfig) -> RolloutEngine:
    if config.engine == "sim":
        sim = config.sim
        return SimEngine(sim.params(), instance_id=config.instance_id, clock=sim.clock, speed=sim.speed)
    from staleflow.config.engines import VllmEngineParams
    from staleflow.engines.vllm_engine import VllmEngine

    assert config.vllm is not None
    params = VllmEngineParams(**config.vllm.model_dump())
    return VllmEngine(params)
