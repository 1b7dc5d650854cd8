"""Where a service's cost model comes from: ``CalibrationRef``, a reference to an entry of a
calibration file (``staleflow.calibration.files.referenced_entry`` reads it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from staleflow.strict import StrictModel


class CalibrationRef(StrictModel):
    """An entry of a calibration file (``calibration:`` in a job or coordinator config). Only a
    reference: validating it never reads the file. The file is read where the service starts
    (``staleflow.calibration.files.resolved_cost``), and the CLI reads it before a job starts, so a
    missing file, an unknown model or a poor fit stops ``staleflow up`` before anything runs."""

    file: Path = Field(description="calibration file written by `staleflow calibrate`")
    model: str | None = Field(None, description="model key; may be left out when the file has one model")
    parallelism: str | None = Field(None, description="parallelism key; may be left out when the model has one")
    allow_poor: bool = Field(False, description="use an entry marked ok=false (a poor fit)")

    @field_validator("file")
    @classmethod
    def _absolute(cls, file: Path) -> Path:
        return file.absolute()  # components started in another directory (`up --processes`) find it too
