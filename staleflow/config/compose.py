"""Each component's config, composed from a job's section for it and the job's endpoints
(``JobConfig`` has these as methods; ``launch/job.py:build_app`` calls one per component)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.config.coordinator import CoordinatorConfig, InstanceEndpoint
from staleflow.config.instance import InstanceConfig, SimConfig, VllmConfig
from staleflow.config.manager import ManagerConfig
from staleflow.config.params import ParamsConfig
from staleflow.config.reward import RewardConfig
from staleflow.config.trajectories import TrajectoryServerConfig

if TYPE_CHECKING:
    from staleflow.config.job import JobConfig


class ComponentConfigs:
    """``JobConfig``'s component configs (a mixin: the job's fields are its state)."""

    def manager_config(self: JobConfig) -> ManagerConfig:
        return ManagerConfig(**dict(self.manager), ledger=self.ledger, state_dir=self.state_dir,
                             db_url=self.database_url())

    def params_config(self: JobConfig) -> ParamsConfig:
        return ParamsConfig(**dict(self.params), state_dir=self.state_dir / "params")

    def reward_config(self: JobConfig) -> RewardConfig:
        return RewardConfig(**dict(self.reward_server))

    def trajectories_config(self: JobConfig, urls: dict[str, str], tokenizer: Path | None) -> TrajectoryServerConfig:
        """``tokenizer``: the model's (a real engine), None for the sim engine's byte tokens."""
        reward = self.reward
        if reward == "auto":
            reward = "sim" if self.engine == "sim" else urls["reward"]
        return TrajectoryServerConfig(
            **dict(self.trajectories), ledger=self.ledger, manager_url=urls["manager"], state_dir=self.state_dir,
            db_url=self.database_url(), seed=self.seed, reward=reward, dataset=self.dataset, task=self.task,
            tokenizer=tokenizer)

    def instance_config(self: JobConfig, name: str, urls: dict[str, str], model: Path | None) -> InstanceConfig:
        """Rollout instance ``name`` (``inst-N``); ``model``: the vllm engine's model directory."""
        index = int(name.split("-")[1])
        engine: dict[str, Any]
        if self.engine == "vllm":
            engine = {"vllm": VllmConfig(**{"seed": self.seed + index, **self.vllm_args, "model": str(model)})}
        else:  # on the real clock, each instance its own seed, all of them the job's workload
            engine = {"sim": SimConfig(workload=self.workload, workload_seed=self.seed, seed=self.seed + index,
                                       clock="real", speed=self.speed, kv_budget=self.kv_budget)}
        return InstanceConfig(**dict(self.instance), instance_id=name, engine=self.engine,
                              completion_callback_url=f"{urls['ts']}/v1/completed", **engine)

    def coordinator_config(self: JobConfig, urls: dict[str, str], instance_ids: list[str],
                           params_urls: dict[str, str | None] | None = None) -> CoordinatorConfig:
        """``params_urls``: where each instance pulls weights, if not from the job's parameter server."""
        return CoordinatorConfig(
            **dict(self.coordinator), manager_url=urls["manager"], ts_url=urls["ts"], params_url=urls["params"],
            instances=[InstanceEndpoint(instance_id=i, url=urls[i], params_url=(params_urls or {}).get(i))
                       for i in instance_ids])
