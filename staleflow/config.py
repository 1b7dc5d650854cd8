"""Typed configuration. Every model validates its fields and names the fix in its messages."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from staleflow.calibration import CalibrationRef
from staleflow.cost_model import CostModel
from staleflow.ledger import LedgerParams
from staleflow.strict import StrictModel


def _check_http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises on a malformed port
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(ord(c) < 33 for c in value):
        raise ValueError(f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8350")
    return value.rstrip("/")


HttpUrl = Annotated[str, AfterValidator(_check_http_url)]
"""An http(s) URL with a host, kept as a string (no trailing slash)."""


class CostConfig(BaseModel):
    """Cost-model coefficients (paper Eq. 2-4, Table 4 defaults; kv in tokens)."""

    model_config = ConfigDict(extra="forbid")
    k1: float = Field(CostModel.k1, ge=0, description="s per KV token read in a decode step")
    k2: float = Field(CostModel.k2, ge=0, description="s, memory-bound GEMM floor")
    k3: float = Field(CostModel.k3, ge=0, description="s per running trajectory when compute-bound")
    k4: float = Field(CostModel.k4, ge=0, description="s, constant per-step overhead")
    k5: float = Field(CostModel.k5, gt=0, description="KV units per token")
    kv_budget: float = Field(CostModel.kv_budget, gt=0, description="KV budget M, in KV units")

    def cost_model(self) -> CostModel:
        return CostModel(**self.model_dump(include=set(CostConfig.model_fields)))


class LedgerConfig(StrictModel):
    eta: int = Field(3, ge=0, description="staleness bound: V_traj + eta >= V_buf for every trajectory")
    batch_size: int = Field(128, ge=1, description="prompt groups per training batch (B)")
    group_size: int = Field(16, ge=1, description="trajectories per prompt group (G)")
    batch_redundancy: float = Field(0.0, ge=0.0, le=4.0, description="extra groups per batch, as a fraction of B")
    group_redundancy: float = Field(0.0, ge=0.0, le=4.0, description="extra trajectories per group, as a fraction of G")

    def params(self) -> LedgerParams:
        return LedgerParams(
            eta=self.eta,
            batch_size=self.batch_size,
            batch_redundancy=self.batch_redundancy,
            group_size=self.group_size,
            group_redundancy=self.group_redundancy,
        )


class ServiceConfig(StrictModel):
    host: str = Field("127.0.0.1", description="address to bind; loopback by default")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")


class ManagerConfig(ServiceConfig):
    ledger: LedgerConfig = LedgerConfig()
    state_dir: Path = Path(".staleflow")
    db_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite file in the state directory")
    synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL", description="SQLite sync level: FULL survives power loss, NORMAL only process crashes"
    )
    port: int = Field(8321, ge=0, le=65535)

    @model_validator(mode="after")
    def _db_url_scheme(self) -> ManagerConfig:
        if self.db_url is not None and "://" not in self.db_url:
            raise ValueError(f"db_url {self.db_url!r} is not a URL; use e.g. sqlite:///path/ledger.db or postgresql://...")
        return self

    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        return f"sqlite:///{(self.state_dir / 'ledger.db').resolve()}"


class AlgorithmConfig(StrictModel):
    """The GRPO/DAPO update and its staleness correction (docs/training.md)."""

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate (measured on the demo policy: docs/training.md)")
    weight_decay: float = Field(0.0, ge=0)
    clip_low: float = Field(0.2, ge=0, le=1, description="PPO ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="DAPO clip-higher: the ratio is clipped above at 1 + clip_high")
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: DAPO token-level mean over the batch; sequence: GRPO mean of per-sequence means")
    normalize_std: bool = Field(True, description="divide group-centred rewards by the group's std (GRPO)")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL penalty to the initial policy (0: none, DAPO)")
    correction: Literal["tis", "decoupled", "none"] = Field(
        "tis", description="staleness correction: truncated importance sampling, decoupled PPO, or none")
    tis_cap: float = Field(2.0, ge=1, description="truncation of the behaviour importance weight")
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch: int = Field(32, ge=1, description="trajectories per forward/backward on each rank")


class TrainerConfig(StrictModel):
    """The trainer: the simulated step-time model (sim engine) or the FSDP2 trainer (vllm engine)."""

    seconds_per_token: float = Field(2e-6, ge=0, description="sim: simulated training seconds per trained token")
    seconds_per_step: float = Field(0.5, ge=0, description="sim: simulated fixed cost per training step")
    push_bytes: int = Field(1 << 20, ge=1, description="sim: bytes of the parameter blob pushed to the PS each step")
    world_size: int = Field(2, ge=1, le=64, description="FSDP2 ranks (processes; gloo on CPU, NCCL on GPU)")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (model, optimizer, version)")
    mixed_precision: bool = Field(False, description="bf16 parameters in forward/backward, fp32 master weights")
    algorithm: AlgorithmConfig = AlgorithmConfig()


class TaskConfig(StrictModel):
    """The built-in verifiable task: arithmetic with exact answers, generated from the seed."""

    digits: int = Field(2, ge=1, le=12, description="digits per operand")
    ops: str = Field("+", pattern=r"^[+\-*]{1,3}$", description="operators drawn from: + - *")


class NodeSelector(StrictModel):
    """Which Ray nodes a role may use: nodes holding the custom ``resource`` and carrying every
    label in ``labels`` (leave either out to select by the other alone)."""

    resource: str | None = Field(None, description="Ray custom resource the role's nodes carry (any amount > 0)")
    labels: dict[str, str] = Field(default_factory=dict, description="Ray node labels the role's nodes carry")


def _role(name: str) -> NodeSelector:
    return NodeSelector(resource=f"staleflow_{name}", labels={"staleflow.io/role": name})


class ClusterConfig(StrictModel):
    """`staleflow up --launcher ray`: where on a Ray cluster each role runs. Read by the Ray
    launcher only; the single-machine runs ignore it."""

    address: str | None = Field(None, description="Ray cluster address (default: $RAY_ADDRESS, else 'auto')")
    namespace: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,100}$",
                                  description="Ray namespace of the job's actors (default: staleflow-<state dir name>)")
    control: NodeSelector = Field(default_factory=lambda: _role("control"),
                                  description="manager, parameter server, reward, trajectory server, coordinator")
    rollout: NodeSelector = Field(default_factory=lambda: _role("rollout"), description="rollout instances")
    trainer: NodeSelector = Field(default_factory=lambda: _role("trainer"), description="trainer ranks")
    cpus_per_service: float = Field(0.1, ge=0, description="CPUs reserved per control service actor")
    cpus_per_instance: float = Field(0.5, ge=0, description="CPUs reserved per rollout instance")
    gpus_per_instance: float = Field(1, ge=0, description="GPUs per rollout instance (its tensor parallelism)")
    cpus_per_rank: float = Field(0.5, ge=0, description="CPUs reserved per trainer rank")
    gpus_per_rank: float = Field(1, ge=0, description="GPUs per trainer rank (0: CPU ranks with gloo)")
    trainer_nodes: int = Field(1, ge=1, description="nodes the trainer ranks spread over (ranks split evenly)")
    port_range: tuple[int, int] = Field(
        (20000, 29999), description="ports for StaleFlow's services, outside Ray's worker ports (10002-19999) "
                                    "and the ephemeral range (32768+)")
    ps_relay: Literal["none", "per_rollout_node"] = Field(
        "none", description="per_rollout_node: a parameter-server relay on each rollout node mirrors every version "
                            "once; the instances there pull from it (shared memory) instead of the central server")
    network_interface: str | None = Field(None, description="NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME of trainer ranks")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of every actor (no secrets)")
    placement_timeout_s: float = Field(60.0, gt=0, description="a placement not ready this long fails the start")
    start_timeout_s: float | None = Field(None, gt=0, description="per component (default: 60 s sim, 900 s vllm)")
    max_restarts: int = Field(-1, ge=-1, description="Ray restarts of each service/instance actor (-1: unlimited)")
    trainer_restarts: int = Field(5, ge=0, description="gang restarts of the trainer ranks before the job fails")

    @model_validator(mode="after")
    def _ports(self) -> ClusterConfig:
        low, high = self.port_range
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"port_range {list(self.port_range)} is not a range of ports; fix: give [low, high] "
                             "with 1024 <= low <= high <= 65535, e.g. [20000, 29999]")
        return self


JOB_LEDGER: dict[str, Any] = {"eta": 2, "batch_size": 16, "group_size": 8}
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    # a simulated cluster: paper-like long responses on four instances, the simulated trainer
    "sim": {"instances": 4, "max_tokens": 2048, "steps": 10},
    # a real job on this machine: two vLLM instances (one process each) and the FSDP2 trainer on
    # the demo model, whose answers are a few tokens long
    "vllm": {"instances": 2, "max_tokens": 24, "steps": 20},
}


class JobConfig(StrictModel):
    """Everything `staleflow up` runs. The same file drives embedded and multi-process runs.
    Fields left out take their engine's defaults (``ENGINE_DEFAULTS``), then the ones below."""

    engine: Literal["sim", "vllm"] = Field("vllm", description="vllm: a real job (vLLM rollouts, FSDP2 trainer); "
                                                             "sim: a simulated cluster")
    steps: int = Field(10, ge=1, description="training steps (buffers consumed) to run")
    state_dir: Path = Path(".staleflow")
    ledger: LedgerConfig = LedgerConfig(**JOB_LEDGER)
    instances: int = Field(4, ge=1, le=1024, description="rollout instances")
    routing: Literal["throughput", "vanilla"] = "throughput"
    sync: Literal["selective", "greedy", "global"] = "selective"
    migration: Literal["throughput", "none"] = "throughput"
    mu: float = Field(0.3, ge=0, le=1)
    phi_wait: int = Field(3, ge=0)
    phi_throughput: float = Field(5.0, ge=1)
    workload: str = Field("demo", description="sim workload preset: demo, ci-tiny, paper-20k, paper-40k")
    max_tokens: int = Field(2048, ge=1, description="response length limit")
    kv_budget: int = Field(int(CostModel.kv_budget), ge=1, description="sim: KV cache budget of each instance, in tokens")
    seed: int = 0
    speed: float = Field(40.0, gt=0, description="sim clock: simulated seconds per real second")
    cycle_period: float = Field(0.05, gt=0, description="coordinator cycle, seconds")
    reward: str = Field("auto", description="auto (sim: 'sim', vllm: the reward server), sim, math or a URL")
    trainer: TrainerConfig = TrainerConfig()
    base_port: int = Field(0, ge=0, le=65000, description="first port of the components; 0 picks free ports")
    host: str = "127.0.0.1"
    processes: bool = Field(False, description="run every component as its own process instead of embedded")
    model: Path | None = Field(None, description="vllm: a local Hugging Face model directory; default: the demo "
                                                 "model (a tiny Qwen2 built and warmed up here on first use)")
    task: TaskConfig = TaskConfig()
    dataset: Path | None = Field(None, description="JSONL/Parquet prompts with answers instead of the built-in task")
    # the coordinator's cost model from a `staleflow calibrate` entry (default: CostConfig's)
    calibration: CalibrationRef | None = Field(None, description="calibration file entry for the coordinator")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="--launcher ray: placement on a Ray cluster")
    vllm_args: dict[str, Any] = Field(
        default_factory=lambda: {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1, "max_num_seqs": 128},
        description="vllm: settings of each instance's engine (staleflow.servers.instance.VllmConfig)")

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            engine = data.get("engine", "vllm")
            data = {**ENGINE_DEFAULTS.get(engine, {}), **data}
            if isinstance(data.get("ledger"), dict):  # a partial ledger section keeps the job's other defaults
                data["ledger"] = {**JOB_LEDGER, **data["ledger"]}
        return data

    @model_validator(mode="after")
    def _engine_needs(self) -> JobConfig:
        if self.engine == "sim":
            from staleflow.workload import PRESETS

            if self.workload not in PRESETS:
                raise ValueError(f"workload {self.workload!r} is not a sim preset; choose one of {sorted(PRESETS)}")
            from staleflow.tasks import ArithmeticTask

            # the sim engine sees the TS's byte tokens; dataset prompts are checked as they are read
            prompt = 1 if self.dataset else ArithmeticTask.longest_prompt_tokens(self.task.digits)
            self._fits("kv_budget", self.kv_budget, "the sim KV budget (kv_budget, tokens)", prompt)
        elif isinstance(limit := self.vllm_args.get("max_model_len"), int):
            self._fits("vllm_args.max_model_len", limit, "vllm_args.max_model_len", 1)  # the model's tokens: >= 1
        return self

    def _fits(self, field: str, capacity: int, what: str, prompt: int) -> None:
        """A prompt of ``prompt`` tokens plus ``max_tokens`` must fit ``capacity``, or nothing can ever run."""
        if prompt + self.max_tokens <= capacity:
            return
        source = f"the task's longest prompt ({prompt} tokens)" if prompt > 1 else "a one-token prompt"
        fix = f"lower max_tokens (--max-tokens) to at most {capacity - prompt} or " if capacity > prompt else ""
        raise ValueError(f"{what} is {capacity}, too small for {source} plus max_tokens {self.max_tokens}; "
                         f"fix: {fix}raise {field} to at least {prompt + self.max_tokens}")
