"""``create_engine``: the rollout engine an instance's settings (``InstanceConfig``) describe. vLLM
is imported only when the settings ask for it."""

from __future__ import annotations

import importlib
import logging
import os

from staleflow.config.instance import InstanceConfig
from staleflow.engines.base import RolloutEngine
from staleflow.engines.sim import SimEngine

log = logging.getLogger(__name__)

ENGINE_FACTORY_ENV = "STALEFLOW_TEST_ENGINE_FACTORY"
"""Test-only: ``module:function`` that builds the engine from the ``InstanceConfig`` instead, so a
test can run a whole job whose instances use an engine of its own (the memory soak's planted leak)."""


def create_engine(config: InstanceConfig) -> RolloutEngine:
    if factory := os.environ.get(ENGINE_FACTORY_ENV):
        module, _, name = factory.partition(":")
        log.warning("%s=%s: a test's engine, not the configured one", ENGINE_FACTORY_ENV, factory)
        return getattr(importlib.import_module(module), name)(config)
    if config.engine == "sim":
        sim = config.sim
        return SimEngine(sim.params(), instance_id=config.instance_id, clock=sim.clock, speed=sim.speed,
                         pull_weights=sim.pull_weights)
    from staleflow.config.engines import VllmEngineParams
    from staleflow.engines.vllm_engine import VllmEngine

    assert config.vllm is not None
    params = VllmEngineParams(**config.vllm.model_dump())
    return VllmEngine(params)
