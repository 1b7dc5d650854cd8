"""``JobConfig``: everything ``staleflow up`` runs, composed of one section per component (the
same settings each service reads on its own), the trainer's and the task's settings, and the
engine presets: the section values a simulated cluster and a real vLLM job differ in.

A job file is nested by component; the settings that have a flag (``eta``, ``routing``,
``max_tokens``, ...) may also be given flat at the top level (``FLAT_SETTINGS`` says where each one
goes), and a flat one wins over the same one in its section, as a flag wins over a file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from staleflow.config.cluster import ClusterConfig
from staleflow.config.common import STATE_DIR, check_database_url, default_of
from staleflow.config.compose import ComponentConfigs
from staleflow.config.coordinator import CoordinatorSettings
from staleflow.config.instance import InstanceSettings, VllmConfig
from staleflow.config.logger import LoggerConfig
from staleflow.config.manager import LedgerConfig, ManagerSettings
from staleflow.config.params import ParamsSettings
from staleflow.config.reward import RewardSettings
from staleflow.config.sections import FLAT_SETTINGS, flat_setting, merged, nested
from staleflow.config.trajectories import TaskConfig, TrajectorySettings
from staleflow.cost_model import CostModel
from staleflow.database_url import DatabaseUrlError, masked, normalize_url
from staleflow.strict import StrictModel


class AlgorithmConfig(StrictModel):
    """The GRPO/DAPO update and its staleness correction (docs/training.md)."""

    lr: float = Field(default=1e-6, gt=0, description="AdamW peak learning rate (1e-6 suits pretrained LLMs; the demo "
                                              "policy trains at 3e-4: DEMO_ALGORITHM, docs/training.md)")
    lr_warmup_steps: int = Field(default=0, ge=0, description="steps of linear warm-up from lr / (warm-up + 1) to lr")
    lr_decay: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="after the warm-up: keep lr, or decay it to lr_min_ratio * lr at the job's last step")
    lr_min_ratio: float = Field(default=0.0, ge=0, le=1, description="the decayed learning rate's floor, as a fraction of lr")
    weight_decay: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, ge=0, le=1, description="PPO ratio clip below: 1 - clip_low")
    clip_high: float = Field(default=0.28, ge=0, description="DAPO clip-higher: the ratio is clipped above at 1 + clip_high")
    loss_aggregation: Literal["token", "sequence"] = Field(
        default="token", description="token: DAPO token-level mean over the batch; sequence: GRPO mean of per-sequence means")
    normalize_std: bool = Field(default=True, description="divide group-centred rewards by the group's std (GRPO)")
    kl_coef: float = Field(default=0.0, ge=0, description="k3 KL penalty to the initial policy (0: none, DAPO)")
    correction: Literal["tis", "decoupled", "none"] = Field(
        default="tis", description="staleness correction: truncated importance sampling, decoupled PPO, or none")
    tis_cap: float = Field(default=2.0, ge=1, description="truncation of the behaviour importance weight")
    max_grad_norm: float = Field(default=1.0, gt=0)
    micro_batch: int = Field(default=32, ge=1, description="trajectories per forward/backward on each rank")


class TrainerConfig(StrictModel):
    """The trainer: the simulated step-time model (sim engine) or the FSDP2 trainer (vllm engine)."""

    seconds_per_token: float = Field(default=2e-6, ge=0, description="sim: simulated training seconds per trained token")
    seconds_per_step: float = Field(default=0.5, ge=0, description="sim: simulated fixed cost per training step")
    push_bytes: int = Field(default=1 << 20, ge=1, description="sim: bytes of the parameter blob pushed to the PS each step")
    world_size: int = Field(default=2, ge=1, le=64, description="FSDP2 ranks (processes; gloo on CPU, NCCL on GPU)")
    checkpoint_every: int = Field(default=5, ge=1, description="steps between checkpoints (model, optimizer, version)")
    remote_push: Literal["http", "nixl"] = Field(
        default="http", description="how a rank off the parameter server's host pushes its weights: http, or nixl (RDMA; "
                            "params.transports must offer it); ranks on the PS's host push over shm")
    mixed_precision: bool | Literal["auto"] = Field(
        default="auto", description="bf16 parameters and activations in forward/backward, fp32 master weights and gradient "
                            "reductions; auto: on with CUDA, off (fp32) on CPU")
    activation_checkpointing: bool | Literal["auto", "selective"] = Field(
        default="auto", description="what backward recomputes of each decoder layer: true (full) recomputes the whole layer "
                            "and keeps only its input; selective keeps the matmul and attention outputs and "
                            "recomputes the pointwise ops; false keeps everything; auto: selective with CUDA, off on "
                            "CPU")
    max_tokens_per_micro_batch: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto", description="micro-batches by token budget: each rank packs trajectories (prompt + response) into "
                            "micro-batches of at most this many tokens (a longer one trains alone); none: "
                            "algorithm.micro_batch trajectories each; auto: on CUDA, the budget a memory model of "
                            "the model's shape and the checkpointing policy fits in token_budget_memory_gib, on CPU "
                            "none")
    token_budget_memory_gib: float = Field(
        default=40.0, gt=0, description="the device memory per rank (GiB) that max_tokens_per_micro_batch: auto plans for, at "
                                "most 95 % of the GPU's; beyond about 10k tokens per micro-batch more memory buys "
                                "little speed")
    packing: bool | Literal["auto"] = Field(
        default="auto", description="padding-free micro-batches: sequences concatenated into one row, attention kept within "
                            "each (varlen attention over their boundaries); auto: with CUDA and torch's varlen "
                            "attention, or with flash attention; true also on CPU (an exact per-sequence fallback)")
    logprob_chunk_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default="auto", description="tokens per chunk of the output head when computing log-probs (the [tokens, vocab] logits "
                            "never exist whole); auto: about 1 GB of fp32 logits per chunk on CUDA (at least 1,024 "
                            "tokens), 32 MB on CPU")
    fused_logprobs: bool | Literal["auto"] = Field(
        default="auto", description="Liger's fused linear cross-entropy for the log-probs on CUDA (the liger extra); auto: "
                            "when liger_kernel is importable, else the chunked head")
    fused_kernels: bool | Literal["auto"] = Field(
        default="auto", description="Liger's fused RMSNorm, RoPE and SwiGLU kernels in the decoder layers (CUDA, the liger "
                            "extra); auto: with CUDA and liger_kernel importable, unless the layers are compiled")
    compile: bool = Field(default=False, description="torch.compile each decoder layer (its checkpointing inside the compiled "
                                             "region, FSDP2 outside; dynamic shapes: one graph for all lengths)")
    optimizer_offload: bool = Field(default=False, description="keep sharded parameters, gradients and optimizer state in "
                                                       "host memory (FSDP2 CPUOffloadPolicy): fits larger models, slower")
    export_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="dtype of the weights the trainer publishes; in a job, auto is the rollout engine's "
                            "(vllm_args.dtype); elsewhere auto keeps the trained parameters' own")
    algorithm: AlgorithmConfig = AlgorithmConfig()


class TrainerRoleConfig(StrictModel):
    """What the trainer role runs with (every rank of it): its section of the job, composed by
    ``JobConfig.trainer_role_config``, not the whole job."""

    backend: Literal["simulated", "fsdp"] = Field(description="simulated (the sim engine's jobs) or FSDP2")
    trainer: TrainerConfig
    steps: int = Field(ge=1, description="training steps (buffers consumed) to run")
    eta: int = Field(ge=0, description="the staleness bound: how far behind the trainer the ledger's buffers reach")
    state_dir: Path = Field(description="the role's own directory: its step log and checkpoints")
    model_dir: Path | None = Field(default=None, description="fsdp: the model to train (a local Hugging Face directory)")
    speed: float = Field(default=1.0, gt=0, description="simulated: simulated seconds per real second")

    @property
    def step_log_path(self) -> Path:
        return self.state_dir / "steps.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.state_dir / "checkpoints"


class SupervisionConfig(StrictModel):
    """How a job keeps its components running: a component that crashes or stops answering is
    restarted in place; one that keeps crashing stops the job (docs/faults.md)."""

    enabled: bool = Field(default=True, description="restart a component that crashes or stops answering")
    probe_interval_s: float = Field(default=0.5, gt=0, description="seconds between health probes of each service")
    probe_timeout_s: float = Field(default=2.0, gt=0, description="a health probe not answered in this time failed")
    probe_failures: int = Field(default=3, ge=1, description="failed health probes in a row that make a service hung")
    max_restarts: int = Field(default=3, ge=0, description="restarts of one component in a row, each failing again within "
                                                   "restart_window_s, before the job stops as a crash loop")
    restart_window_s: float = Field(default=60.0, gt=0, description="a restarted component that stays up this long is "
                                                            "healthy again: its crash-loop count starts over")
    warm_standby: bool = Field(default=True, description="--processes: keep one process with every role's code imported, "
                                                 "so a failed role restarts without a cold start")


JOB_LEDGER: dict[str, Any] = {"eta": 2, "batch_size": 16, "group_size": 8}
DEMO_ALGORITHM: dict[str, Any] = {"lr": 3e-4, "lr_warmup_steps": 3, "lr_decay": "cosine", "lr_min_ratio": 0.1}
"""The update the demo policy trains with (docs/training.md: how it was chosen); a job with its own
``--model`` starts from ``AlgorithmConfig``'s defaults instead, which suit pretrained LLMs."""
SIM_PRESET: dict[str, Any] = {
    # a simulated cluster: paper-like long responses on four instances, the simulated trainer
    "instances": 4, "max_tokens": 2048, "steps": 10,
    # instances on the simulated clock answer at once: five silent seconds mean a failure
    "coordinator": {"failure_timeout": 5.0},
    # a few recent versions are enough and a crash of this machine ends the run anyway
    "params": {"keep": 3, "fsync": False},
}
VLLM_PRESET: dict[str, Any] = {
    # a real job on this machine: two vLLM instances (one process each) and the FSDP2 trainer on
    # the demo model, whose direct answers are a few tokens long (its worked ones do not fit in 24)
    "instances": 2, "max_tokens": 24, "steps": 20, "task": {"digits": 1, "ops": "+"},
    # a real engine on a busy CPU can take tens of seconds for a step or a weight load
    "coordinator": {"failure_timeout": 60.0, "command_timeout": 120.0, "stall_timeout": 120.0},
    "params": {"keep": 3, "fsync": False},
}
ENGINE_PRESETS: dict[str, dict[str, Any]] = {"sim": SIM_PRESET, "vllm": VLLM_PRESET}
"""What each engine changes of the defaults below; a job's own values win over its engine's."""

ROLLOUT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                  "float": "float32"}
"""vLLM's ``dtype`` spellings of the dtypes a trainer can export; another (vLLM's ``auto``) keeps the trainer's."""


def _exporting_the_rollout_dtype(trainer: Any, vllm_args: Any) -> Any:
    """The trainer section with ``export_dtype: auto`` resolved to the instances' engine dtype."""
    if isinstance(trainer, TrainerConfig):
        trainer = trainer.model_dump(exclude_unset=True)
    trainer = dict(trainer or {})
    if trainer.get("export_dtype", "auto") != "auto":
        return trainer
    if isinstance(vllm_args, dict):
        rollout = vllm_args.get("dtype", default_of(VllmConfig, "dtype"))
    else:
        rollout = JobConfig.model_fields["vllm_args"].get_default(call_default_factory=True)["dtype"]
    trainer["export_dtype"] = ROLLOUT_DTYPES.get(str(rollout), "auto")
    return trainer


class JobConfig(ComponentConfigs, StrictModel):
    """Everything `staleflow up` runs. The same file drives embedded and multi-process runs.
    Fields left out take their engine's preset (``ENGINE_PRESETS``), then the defaults below."""

    engine: Literal["sim", "vllm"] = Field(default="vllm", description="vllm: a real job (vLLM rollouts, FSDP2 trainer); "
                                                             "sim: a simulated cluster")
    steps: int = Field(default=10, ge=1, description="training steps (buffers consumed) to run")
    state_dir: Path = STATE_DIR
    ledger: LedgerConfig = LedgerConfig(**JOB_LEDGER)
    instances: int = Field(default=4, ge=1, le=1024, description="rollout instances")
    workload: str = Field(default="demo", description="sim workload preset: demo, ci-tiny, paper-20k, paper-40k")
    kv_budget: int = Field(default=int(CostModel.kv_budget), ge=1, description="sim: KV cache budget of each instance, in tokens")
    seed: int = 0
    speed: float = Field(default=40.0, gt=0, description="sim clock: simulated seconds per real second")
    reward: str = Field(default="auto", description="auto (sim: 'sim', vllm: the reward server), sim, math or a URL")
    trainer: TrainerConfig = TrainerConfig()
    supervision: SupervisionConfig = SupervisionConfig()
    base_port: int = Field(default=0, ge=0, le=65000, description="first port of the components; 0 picks free ports")
    host: str = "127.0.0.1"
    processes: bool = Field(default=False, description="run every component as its own process instead of embedded")
    model: Path | None = Field(default=None, description="vllm: a local Hugging Face model directory; default: the demo "
                                                 "model (a tiny Qwen2 built and warmed up here on first use)")
    task: TaskConfig = TaskConfig()
    logger: LoggerConfig = Field(default=LoggerConfig(), description="per-step metrics: console, tensorboard, wandb, mlflow")
    dataset: Path | None = Field(default=None, description="JSONL/Parquet prompts with answers instead of the built-in task")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="--launcher ray: placement on a Ray cluster")
    vllm_args: dict[str, Any] = Field(
        default_factory=lambda: {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1, "max_num_seqs": 128},
        description="vllm: settings of each instance's engine (staleflow.config.VllmConfig)")
    db_url: str | None = Field(
        default=None, description="database of the ledger and the trajectory store (one for both), e.g. "
                          "postgresql+psycopg://staleflow@db:5432/staleflow; default: SQLite files in state_dir")
    db_url_file: Path | None = Field(
        default=None, description="a file holding db_url (e.g. a mounted Kubernetes Secret): its password stays out of "
                          "the job file and the environment")
    # one section per component: what the job sets of it (where it listens and what it talks to
    # come from the job's endpoints)
    manager: ManagerSettings = Field(default_factory=ManagerSettings, description="the staleness manager")
    params: ParamsSettings = Field(default_factory=ParamsSettings, description="the parameter server")
    reward_server: RewardSettings = Field(default_factory=RewardSettings, description="the reward server")
    trajectories: TrajectorySettings = Field(default_factory=TrajectorySettings,
                                             description="the trajectory server (max_tokens: sampling.max_tokens)")
    instance: InstanceSettings = Field(default_factory=InstanceSettings, description="every rollout instance")
    coordinator: CoordinatorSettings = Field(default_factory=CoordinatorSettings,
                                             description="the coordinator: strategy, cycle, timeouts, cost model")

    flat_settings: ClassVar[dict[str, tuple[str, ...]]] = FLAT_SETTINGS
    # the flat settings, read back from their sections
    routing = flat_setting("coordinator", "strategy", "routing")
    sync = flat_setting("coordinator", "strategy", "sync")
    migration = flat_setting("coordinator", "strategy", "migration")
    mu = flat_setting("coordinator", "strategy", "mu")
    phi_wait = flat_setting("coordinator", "strategy", "phi_wait")
    phi_throughput = flat_setting("coordinator", "strategy", "phi_throughput")
    cycle_period = flat_setting("coordinator", "cycle_period")
    calibration = flat_setting("coordinator", "calibration")
    max_tokens = flat_setting("trajectories", "sampling", "max_tokens")
    progress_tokens = flat_setting("instance", "progress_tokens")

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            engine = data.get("engine", "vllm")
            preset = nested(ENGINE_PRESETS.get(engine, {}))
            if engine == "vllm" and data.get("model") is None:  # the demo policy's own update
                preset = merged(preset, {"trainer": {"algorithm": DEMO_ALGORITHM}})
            data = merged(preset, nested(data))
            if isinstance(data.get("ledger"), dict):  # a partial ledger section keeps the job's other defaults
                data["ledger"] = {**JOB_LEDGER, **data["ledger"]}
            if engine == "vllm":
                data["trainer"] = _exporting_the_rollout_dtype(data.get("trainer"), data.get("vllm_args"))
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
        migration = self.coordinator.strategy.migration
        if (self.engine == "vllm" and migration.repacks
                and (self.vllm_args.get("engine_args") or {}).get("disable_log_stats")):
            raise ValueError(f"migration {migration.value} repacks by each instance's KV utilisation, which vLLM "
                             "reports only with its stats on: drop vllm_args.engine_args.disable_log_stats, or "
                             "choose migration: starved (or throughput, none)")
        return self

    _db_url_supported = field_validator("db_url")(check_database_url)

    @model_validator(mode="after")
    def _remote_push_offered(self) -> JobConfig:
        if self.trainer.remote_push not in self.params.transports:
            offered = ", ".join(self.params.transports)
            raise ValueError(f"trainer.remote_push is {self.trainer.remote_push!r} but the parameter server offers "
                             f"{offered}: add it to params.transports (e.g. [{offered}, {self.trainer.remote_push}])")
        return self

    @model_validator(mode="after")
    def _one_database(self) -> JobConfig:
        if self.db_url is not None and self.db_url_file is not None:
            raise ValueError("set db_url or db_url_file, not both")
        return self

    def trainer_role_config(self, model_dir: Path | None = None) -> TrainerRoleConfig:
        """The trainer role's section; ``model_dir``: the resolved model (the FSDP2 trainer's)."""
        return TrainerRoleConfig(backend="simulated" if self.engine == "sim" else "fsdp", trainer=self.trainer,
                                 steps=self.steps, eta=self.ledger.eta, state_dir=self.state_dir / "trainer",
                                 model_dir=model_dir, speed=self.speed)

    def database_url(self) -> str | None:
        """The database URL of the durable state (None: SQLite files in ``state_dir``)."""
        if self.db_url_file is None:
            return self.db_url
        try:
            url = self.db_url_file.read_text().strip()
        except OSError as exc:
            raise DatabaseUrlError(f"db_url_file {self.db_url_file}: cannot read it ({exc.strerror or exc})") from None
        if not url:
            raise DatabaseUrlError(f"db_url_file {self.db_url_file} is empty; write the database URL into it")
        try:
            normalize_url(url)
        except DatabaseUrlError as exc:
            raise DatabaseUrlError(f"db_url_file {self.db_url_file}: {exc}") from None
        return url

    def database_label(self) -> str:
        """Where the durable state's database is, for messages (no password)."""
        url = self.database_url()
        return masked(url) if url else f"SQLite in {self.state_dir}"

    def _fits(self, field: str, capacity: int, what: str, prompt: int) -> None:
        """A prompt of ``prompt`` tokens plus ``max_tokens`` must fit ``capacity``, or nothing can ever run."""
        if prompt + self.max_tokens <= capacity:
            return
        source = f"the task's longest prompt ({prompt} tokens)" if prompt > 1 else "a one-token prompt"
        fix = f"lower max_tokens (--max-tokens) to at most {capacity - prompt} or " if capacity > prompt else ""
        raise ValueError(f"{what} is {capacity}, too small for {source} plus max_tokens {self.max_tokens}; "
                         f"fix: {fix}raise {field} to at least {prompt + self.max_tokens}")
