"""Where each role of a job runs on a Ray cluster (``staleflow up --launcher ray``, docs/ray.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from staleflow.strict import StrictModel


class NodeSelector(StrictModel):
    """Which Ray nodes a role may use: nodes holding the custom ``resource`` and carrying every
    label in ``labels`` (leave either out to select by the other alone)."""

    resource: str | None = Field(default=None, description="Ray custom resource the role's nodes carry (any amount > 0)")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels the role's nodes carry")


class ClusterConfig(StrictModel):
    """`staleflow up --launcher ray`: where on a Ray cluster each role runs. Read by the Ray
    launcher only; the single-machine runs ignore it."""

    address: str | None = Field(default=None, description="Ray cluster address (default: $RAY_ADDRESS, else 'auto')")
    namespace: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,100}$",
                                  description="Ray namespace of the job's actors (default: staleflow-<state dir name>)")
    control: NodeSelector | None = Field(
        default=None, description="nodes of the manager, parameter server, reward, trajectory server and coordinator "
                          "(default: the nodes marked for the role, else any node with room, the driver's first)")
    rollout: NodeSelector | None = Field(
        default=None, description="nodes of the rollout instances (default: the nodes marked for the role, else any node "
                          "with room)")
    trainer: NodeSelector | None = Field(
        default=None, description="nodes of the trainer ranks (default: the nodes marked for the role, else any node with room)")
    cpus_per_service: float = Field(default=0.1, ge=0, description="CPUs reserved per control service actor")
    cpus_per_instance: float = Field(default=0.5, ge=0, description="CPUs reserved per rollout instance")
    gpus_per_instance: float | None = Field(
        default=None, ge=0, description="GPUs per rollout instance, its tensor parallelism (default: 1; 0 for the sim engine)")
    cpus_per_rank: float = Field(default=0.5, ge=0, description="CPUs reserved per trainer rank")
    gpus_per_rank: float | None = Field(
        default=None, ge=0, description="GPUs per trainer rank, 0: CPU ranks with gloo (default: 1; 0 for the sim engine)")
    trainer_nodes: int = Field(default=1, ge=1, description="nodes the trainer ranks spread over (ranks split evenly)")
    port_range: tuple[int, int] = Field(
        default=(20000, 29999), description="ports for StaleFlow's services, outside Ray's worker ports (10002-19999) "
                                    "and the ephemeral range (32768+)")
    ps_relay: Literal["none", "per_rollout_node"] = Field(
        default="none", description="per_rollout_node: a parameter-server relay on each rollout node mirrors every version "
                            "once; the instances there pull from it (shared memory) instead of the central server")
    network_interface: str | None = Field(default=None, description="NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME of trainer ranks")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of every actor (no secrets)")
    placement_timeout_s: float = Field(default=60.0, gt=0, description="a placement not ready this long fails the start")
    start_timeout_s: float | None = Field(default=None, gt=0, description="per component (default: 60 s sim, 900 s vllm)")
    max_restarts: int = Field(default=-1, ge=-1, description="Ray restarts of each service/instance actor (-1: unlimited)")
    trainer_restarts: int = Field(default=5, ge=0, description="gang restarts of the trainer ranks before the job fails")

    @model_validator(mode="after")
    def _ports(self) -> ClusterConfig:
        low, high = self.port_range
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"port_range {list(self.port_range)} is not a range of ports; fix: give [low, high] "
                             "with 1024 <= low <= high <= 65535, e.g. [20000, 29999]")
        return self
