"""Every component's settings, in one tree. Each model validates its fields and names the fix in
its messages.

* ``common``: the strict base, ``HttpUrl``, ``ServiceConfig`` (where a service listens);
* ``manager``: the ledger and the staleness manager;
* ``params``: the parameter server;
* ``reward``: the reward server;
* ``trajectories``: the trajectory server and the built-in task;
* ``instance``: a rollout instance and its sim / vLLM engine;
* ``coordinator``: the coordinator, which contains the strategy;
* ``strategy``: the coordination strategy's settings (``StrategyConfig``), which ``staleflow.strategies`` runs;
* ``job``: ``JobConfig``, one section per component, the trainer, and the engine presets.

A component's ``XSettings`` is what a job sets of it (its section of ``JobConfig``); its ``XConfig``
adds where it listens and what it talks to, and is what the service runs with. The cost model's
coefficients are declared once, ``CostCoefficients`` (``CostConfig`` here)."""

from staleflow.config.cluster import ClusterConfig, NodeSelector
from staleflow.config.common import HttpUrl, ServiceConfig, check_database_url, default_of
from staleflow.config.coordinator import CoordinatorConfig, CoordinatorSettings, InstanceEndpoint
from staleflow.config.cost import CostCoefficients
from staleflow.config.instance import InstanceConfig, InstanceSettings, SimConfig, VllmConfig
from staleflow.config.job import (
    DEMO_ALGORITHM,
    ENGINE_PRESETS,
    FLAT_SETTINGS,
    JOB_LEDGER,
    AlgorithmConfig,
    JobConfig,
    SupervisionConfig,
    TrainerConfig,
)
from staleflow.config.manager import LedgerConfig, ManagerConfig, ManagerSettings
from staleflow.config.params import ParamsConfig, ParamsSettings
from staleflow.config.reward import RewardConfig, RewardSettings
from staleflow.config.trajectories import SamplingConfig, TaskConfig, TrajectoryServerConfig, TrajectorySettings
from staleflow.strict import StrictModel

CostConfig = CostCoefficients
"""The cost model's coefficients (one model: ``staleflow.config.cost.CostCoefficients``)."""

__all__ = [
    "ClusterConfig",
    "NodeSelector",
    "DEMO_ALGORITHM",
    "ENGINE_PRESETS",
    "FLAT_SETTINGS",
    "JOB_LEDGER",
    "AlgorithmConfig",
    "CoordinatorConfig",
    "CoordinatorSettings",
    "CostCoefficients",
    "CostConfig",
    "HttpUrl",
    "InstanceConfig",
    "InstanceEndpoint",
    "InstanceSettings",
    "JobConfig",
    "LedgerConfig",
    "ManagerConfig",
    "ManagerSettings",
    "ParamsConfig",
    "ParamsSettings",
    "RewardConfig",
    "RewardSettings",
    "SamplingConfig",
    "ServiceConfig",
    "SimConfig",
    "StrictModel",
    "TaskConfig",
    "SupervisionConfig",
    "TrainerConfig",
    "TrajectoryServerConfig",
    "TrajectorySettings",
    "VllmConfig",
    "check_database_url",
    "default_of",
]
