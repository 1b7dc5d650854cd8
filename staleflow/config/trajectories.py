"""The trajectory server's settings, and the built-in task it draws prompts from."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from staleflow.config.common import STATE_DIR, HttpUrl, ServiceConfig, check_database_url
from staleflow.config.manager import MANAGER_URL, LedgerConfig
from staleflow.strict import StrictModel


class SamplingConfig(StrictModel):
    max_tokens: int = Field(default=1024, ge=1, description="response length limit per trajectory")
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)


class TaskConfig(StrictModel):
    """The built-in verifiable task: arithmetic with exact answers, generated from the seed."""

    digits: int = Field(default=2, ge=1, le=12, description="digits per operand")
    ops: str = Field(default="+", pattern=r"^[+\-*]{1,3}$", description="operators drawn from: + - *")


class TrajectorySettings(StrictModel):
    """What a job sets of the trajectory server (its ``trajectories:`` section; the job's
    ``max_tokens`` is ``sampling.max_tokens``)."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    max_prompt_chars: int = Field(default=8192, ge=1)
    max_prompt_tokens: int = Field(default=4096, ge=1, description="prompts longer than this (in tokens) are skipped and counted")
    sampling: SamplingConfig = SamplingConfig()
    sim_success_rate: float = Field(default=0.5, ge=0, le=1, description="mean reward of the 'sim' reward")
    filter_zero_variance: bool = Field(default=False, description="DAPO: abort groups whose rewards are all equal")
    follow_interval: float = Field(default=0.2, gt=0, description="seconds between polls of the ledger's event log")
    finished_lengths_kept: int = Field(
        default=10_000, ge=1, description="the newest finished trajectories' lengths kept for the coordinator's length "
                                          "predictor to follow (GET /v1/finished-lengths); older ones are pruned")
    retention: Literal["archive", "drop"] = Field(
        default="archive", description="where a finished group (freed or aborted, every member done) goes when it leaves the "
                               "live store: 'archive' (append-only archive tables) or 'drop' (deleted)")


class TrajectoryServerConfig(TrajectorySettings, ServiceConfig):
    ledger: LedgerConfig = LedgerConfig()
    manager_url: HttpUrl = MANAGER_URL
    state_dir: Path = STATE_DIR
    db_url: str | None = Field(default=None, description="SQLAlchemy URL; default: SQLite file in the state directory")
    _db_url_supported = field_validator("db_url")(check_database_url)
    dataset: Path | None = Field(default=None, description="JSONL or Parquet with prompt and answer fields; default: built-in task")
    tokenizer: Path | None = Field(default=None, description="the model's tokenizer (directory or tokenizer.json); "
                                                     "default: UTF-8 bytes, for simulated engines")
    task: TaskConfig = TaskConfig(digits=3, ops="+-*")
    seed: int = 0
    reward: Literal["math", "sim"] | str = Field(
        default="math", description="'math' (built-in verifier), 'sim' (seeded random, for the sim engine) or a reward server URL"
    )
    vocab_size: int | None = Field(
        default=None, ge=1, description="the model's vocabulary: a trajectory with a token id at or above it is refused (422 "
                                "invalid_token); none: ids are bounded by their storage type (int32) only. A job sets "
                                "it from its model's config.json or its sim workload")

    @model_validator(mode="after")
    def _reward_choice(self) -> TrajectoryServerConfig:
        if self.reward not in ("math", "sim") and not self.reward.startswith(("http://", "https://")):
            raise ValueError(f"reward must be 'math', 'sim' or a reward server URL, got {self.reward!r}")
        return self

    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.state_dir / 'trajectories.db').resolve()}"

    def target_groups(self) -> int:
        """Groups kept in flight: (eta + 1) x the groups admitted per buffer."""
        return (self.ledger.eta + 1) * self.ledger.params().capacity
