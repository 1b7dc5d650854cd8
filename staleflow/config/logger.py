"""Where a job's per-step metrics go: ``LoggerConfig`` (``staleflow.tracking`` writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from staleflow.strict import StrictModel

LoggerBackend = Literal["console", "tensorboard", "wandb", "mlflow"]


class LoggerConfig(StrictModel):
    """Where the job's per-step metrics go (docs/observability.md). Also written as a list or a
    comma-separated string of backends: ``logger: [console, tensorboard]``."""

    backends: tuple[LoggerBackend, ...] = Field(
        default=("console",), description="console, plus any of tensorboard, wandb (offline), mlflow (local file store)")
    directory: Path | None = Field(default=None, description="where backends write; default <state_dir>/tracking")
    project: str = Field(default="staleflow", min_length=1, description="W&B project / MLflow experiment")
    run_name: str | None = Field(default=None, description="default: the state directory's name")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="default: a file store in <directory>/mlruns; or sqlite:///..., http://...")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = [part.strip() for part in data.split(",") if part.strip()]
        if isinstance(data, list | tuple):
            return {"backends": tuple(data)}
        return data
