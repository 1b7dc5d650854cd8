"""Every component's settings, in one tree. Each model validates its fields and names the fix in
its messages. The tree is the library's lowest floor but one: it imports only the leaf modules
(``strict``, ``database_url``, ``cost_model``, ``workload``, ``tasks``); the engines, strategies,
calibration and simulation import their settings from here.

* ``common``: the strict base, ``HttpUrl``, ``ServiceConfig`` (where a service listens);
* ``manager``: the ledger's parameters (``LedgerParams``, ``LedgerConfig``) and the staleness manager;
* ``params``: the parameter server;
* ``reward``: the reward server;
* ``trajectories``: the trajectory server and the built-in task;
* ``instance``: a rollout instance and its sim / vLLM engine sections;
* ``engines``: what the engines are built with (``SimParams``, ``Clock``, ``VllmEngineParams``);
* ``coordinator``: the coordinator, which contains the strategy;
* ``strategy``: the coordination strategy's settings (``StrategyConfig``), which ``staleflow.strategies`` runs;
* ``cost``: the cost model's coefficients (``CostCoefficients``);
* ``calibration``: ``CalibrationRef`` (an entry of a calibration file) and ``ProfileConfig`` (the calibrate grid);
* ``logger``: where a job's per-step metrics go (``LoggerConfig``);
* ``cluster``: placement on a Ray cluster (``ClusterConfig``);
* ``compose``: each component's config composed from a job's sections;
* ``job``: ``JobConfig``, one section per component, the trainer, and the engine presets;
* ``files``: a job file's settings read from YAML, TOML or JSON (``read_settings_file``).

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
    TrainerRoleConfig,
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
    "TrainerRoleConfig",
    "TrajectoryServerConfig",
    "TrajectorySettings",
    "VllmConfig",
    "check_database_url",
    "default_of",
]
