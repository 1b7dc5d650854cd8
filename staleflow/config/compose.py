"""Each component's config, composed from a job's section for it and the job's endpoints
(``JobConfig`` has these as methods; ``launch/plan.py:build_app`` calls one per component)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

from staleflow.config.coordinator import CoordinatorConfig, CoordinatorSettings, InstanceEndpoint
from staleflow.config.engines import Clock
from staleflow.config.instance import InstanceConfig, InstanceSettings, SimConfig, VllmConfig
from staleflow.config.manager import LedgerConfig, ManagerConfig, ManagerSettings
from staleflow.config.params import ParamsConfig, ParamsSettings, default_retain
from staleflow.config.reward import RewardConfig, RewardSettings
from staleflow.config.trajectories import TaskConfig, TrajectoryServerConfig, TrajectorySettings


class JobSections(Protocol):
    """What the composition reads of a job (``JobConfig`` has all of it), so that this module need
    not import the job's."""

    engine: Literal["sim", "vllm"]
    state_dir: Path
    seed: int
    ledger: LedgerConfig
    manager: ManagerSettings
    params: ParamsSettings
    reward: str
    reward_server: RewardSettings
    trajectories: TrajectorySettings
    dataset: Path | None
    task: TaskConfig
    instance: InstanceSettings
    vllm_args: dict[str, Any]
    workload: str
    speed: float
    kv_budget: int
    coordinator: CoordinatorSettings

    def database_url(self) -> str | None: ...


def model_vocab_size(model: Path | None) -> int | None:
    """The vocabulary of a Hugging Face model directory (its embedding rows: ``vocab_size`` in its
    config.json, or in its ``text_config`` for a multimodal one); None when it does not say."""
    if model is None:
        return None
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    size = config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


class ComponentConfigs:
    """``JobConfig``'s component configs (a mixin: the job's fields are its state)."""

    def manager_config(self: JobSections) -> ManagerConfig:
        return ManagerConfig(**dict(self.manager), ledger=self.ledger, state_dir=self.state_dir,
                             db_url=self.database_url())

    def params_config(self: JobSections) -> ParamsConfig:
        settings = dict(self.params)
        if settings["retain"] is None and self.params.sources == "ros":  # what the ledger's staleness bound routes to
            settings["retain"] = default_retain(self.ledger.eta)
        return ParamsConfig(**settings, state_dir=self.state_dir / "params")

    def reward_config(self: JobSections) -> RewardConfig:
        return RewardConfig(**dict(self.reward_server))

    def trajectories_config(self: JobSections, urls: dict[str, str], tokenizer: Path | None) -> TrajectoryServerConfig:
        """``tokenizer``: the model's (a real engine), None for the sim engine's byte tokens."""
        reward = self.reward
        if reward == "auto":
            reward = "sim" if self.engine == "sim" else urls["reward"]
        if self.engine == "sim":
            from staleflow.workload import PRESETS

            vocab_size = PRESETS[self.workload].vocab_size
        else:
            vocab_size = model_vocab_size(tokenizer)
        return TrajectoryServerConfig(
            **dict(self.trajectories), ledger=self.ledger, manager_url=urls["manager"], state_dir=self.state_dir,
            db_url=self.database_url(), seed=self.seed, reward=reward, dataset=self.dataset, task=self.task,
            tokenizer=tokenizer, vocab_size=vocab_size)

    def instance_config(self: JobSections, name: str, urls: dict[str, str], model: Path | None) -> InstanceConfig:
        """Rollout instance ``name`` (``inst-N``); ``model``: the vllm engine's model directory."""
        index = int(name.split("-")[1])
        engine: dict[str, Any]
        if self.engine == "vllm":
            engine = {"vllm": VllmConfig(**{"seed": self.seed + index, **self.vllm_args, "model": str(model)})}
        else:  # on the real clock, each instance its own seed, all of them the job's workload
            engine = {"sim": SimConfig(workload=self.workload, workload_seed=self.seed, seed=self.seed + index,
                                       clock=Clock.REAL, speed=self.speed, kv_budget=self.kv_budget,
                                       pull_weights=self.params.sources == "ros")}
        return InstanceConfig(**dict(self.instance), instance_id=name, engine=self.engine,
                              completion_callback_url=f"{urls['ts']}/v1/completed",
                              progress_url=f"{urls['ts']}/v1/progress", **engine)

    def coordinator_config(self: JobSections, urls: dict[str, str], instance_ids: list[str],
                           params_urls: dict[str, str | None] | None = None) -> CoordinatorConfig:
        """``params_urls``: where each instance pulls weights, if not from the job's parameter server."""
        return CoordinatorConfig(
            **dict(self.coordinator), manager_url=urls["manager"], ts_url=urls["ts"], params_url=urls["params"],
            instances=[InstanceEndpoint(instance_id=i, url=urls[i], params_url=(params_urls or {}).get(i))
                       for i in instance_ids])
