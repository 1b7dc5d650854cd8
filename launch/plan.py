"""What every launcher runs: the job's components in start order, their planned endpoints, the
app each component serves and the trainer role, all from one ``JobConfig``.

The local launcher (``staleflow.launch.local``), the Ray launcher (``staleflow.launch.ray``), a
component's own process (``staleflow serve component``) and a warm standby
(``staleflow.launch.standby``) build a component through ``build_app`` and the trainer through
``run_trainer``, so a component runs the same code wherever it is placed.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi import FastAPI

from staleflow.config import JobConfig
from staleflow.ports import free_port
from staleflow.training.role import StepLog, run_trainer_role

STATIC_COMPONENTS = ("manager", "params", "reward", "ts")
TRAINER = "trainer"  # the trainer role: one component to the supervisor, whatever its ranks
STARTED_ENV = "STALEFLOW_JOB_STARTED"  # the job's time.monotonic() at start, for a trainer process


def instance_ids(config: JobConfig) -> list[str]:
    return [f"inst-{i}" for i in range(config.instances)]


def component_names(config: JobConfig) -> list[str]:
    """Start order: each component only needs those before it."""
    return [*STATIC_COMPONENTS, *instance_ids(config), "coordinator"]


def plan_endpoints(config: JobConfig) -> dict[str, dict]:
    """Each component's address on this machine: consecutive ports from ``base_port``, else free ones."""
    endpoints = {}
    for offset, name in enumerate(component_names(config)):
        port = config.base_port + offset if config.base_port else free_port(config.host)
        endpoints[name] = {"url": f"http://{config.host}:{port}", "host": config.host, "port": port}
    return endpoints


def model_dir(config: JobConfig) -> Path:
    from staleflow.training.demo import resolve_model

    return resolve_model(config)


def build_app(name: str, config: JobConfig, endpoints: dict[str, dict]) -> FastAPI:
    """The FastAPI app of one component of the job, with the config ``JobConfig`` composes for it."""
    url = {k: v["url"] for k, v in endpoints.items()}
    model = model_dir(config) if config.engine != "sim" and (name == "ts" or name.startswith("inst-")) else None
    if name == "manager":
        from staleflow.servers.manager import create_app as manager_app

        return manager_app(config.manager_config())
    if name == "params":
        from staleflow.servers.params import create_app as params_app

        return params_app(config.params_config())
    if name == "reward":
        from staleflow.servers.reward import create_app as reward_app

        return reward_app(config.reward_config())
    if name == "ts":
        from staleflow.servers.trajectories import create_app as ts_app

        return ts_app(config.trajectories_config(url, tokenizer=model))
    if name.startswith("inst-"):
        from staleflow.servers.instance import create_app as instance_app

        return instance_app(config.instance_config(name, url, model))
    if name == "coordinator":
        from staleflow.coordinator.app import create_app as coordinator_app

        return coordinator_app(config.coordinator_config(
            url, instance_ids(config), {i: endpoints[i].get("params_url") for i in instance_ids(config)}))
    raise ValueError(f"unknown component {name!r}; components are {', '.join(component_names(config))}")


def trainer_label(config: JobConfig) -> str:
    if config.engine == "sim":
        from staleflow.training.simulated import SimulatedBackend

        return SimulatedBackend.label
    return f"FSDP2 trainer ({config.trainer.world_size} ranks, {config.trainer.algorithm.correction} correction)"


def step_log(config: JobConfig) -> StepLog:
    return StepLog(config.trainer_role_config().step_log_path)


def run_trainer(config: JobConfig, endpoints: dict[str, dict], stop: threading.Event, started: float | None = None) -> None:
    """The trainer role until ``config.steps`` buffers are trained (or ``stop``), with its section of the job."""
    urls = {k: v["url"] for k, v in endpoints.items()}
    role = config.trainer_role_config(None if config.engine == "sim" else model_dir(config))
    run_trainer_role(role, urls, stop, started)
