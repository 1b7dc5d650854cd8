"""Calibration's settings: ``CalibrationRef``, where a service's cost model comes from (an entry of
a calibration file, which ``staleflow.calibration.files.referenced_entry`` reads), and
``ProfileConfig``, the grid ``staleflow calibrate`` measures (``staleflow.calibration.profile``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator

from staleflow.strict import StrictModel


class CalibrationRef(StrictModel):
    """An entry of a calibration file (``calibration:`` in a job or coordinator config). Only a
    reference: validating it never reads the file. The file is read where the service starts
    (``staleflow.calibration.files.resolved_cost``), and the CLI reads it before a job starts, so a
    missing file, an unknown model or a poor fit stops ``staleflow up`` before anything runs."""

    file: Path = Field(description="calibration file written by `staleflow calibrate`")
    model: str | None = Field(default=None, description="model key; may be left out when the file has one model")
    parallelism: str | None = Field(default=None, description="parallelism key; may be left out when the model has one")
    allow_poor: bool = Field(default=False, description="use an entry marked ok=false (a poor fit)")

    @field_validator("file")
    @classmethod
    def _absolute(cls, file: Path) -> Path:
        return file.absolute()  # components started in another directory (`up --processes`) find it too


@dataclass(frozen=True)
class ProfileConfig:
    """The profiling grid and how long to look at each point."""

    n_values: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    contexts: tuple[int, ...] = (256, 1024, 4096, 16384)  # prompt tokens per trajectory
    samples_per_point: int = 4
    steps_per_sample: int = 256  # decode steps per interval (fewer if a real-time cap bites)
    min_sample_seconds: float = 0.0  # real-time engines: interval length bounds
    max_sample_seconds: float = math.inf
    kv_fill: float = 0.85  # a point may hold at most this fraction of the KV budget
    prefill_contexts: tuple[int, ...] = (256, 1024, 4096)
    prefill_reps: int = 2
    weight_loads: int = 2
    max_repeats: int = 4  # re-measure a point up to this often when the budget shortens its responses
    passes: int = 1  # measure the grid this often (alternating order); each point keeps its fastest pass
    trim: float | None = None  # drop intervals off their point's median by more than this factor
    max_foreign_load: float | None = None  # real time: drop intervals in which others used > this many cores
    retries: int = 0  # real time: re-measure a point this often while its intervals are disturbed
    subtract_wait: bool = False  # real time: time an interval without the engine thread's run-queue wait
    retry_pause_s: float = 1.0
    timeout_s: float = 300.0  # real-time engines: give up on a point after this long
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_values", "contexts", "prefill_contexts"):
            values = getattr(self, name)
            object.__setattr__(self, name, tuple(sorted(set(values))))
            if any(v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values}")
        if len(self.n_values) < 2:
            raise ValueError(f"n_values needs >= 2 running counts to separate k3 from k4, got {self.n_values}")
        if not self.contexts:
            raise ValueError("contexts must not be empty")
        if self.samples_per_point < 1 or self.steps_per_sample < 4:
            raise ValueError("samples_per_point must be >= 1 and steps_per_sample >= 4")
        if not 0 < self.kv_fill <= 1:
            raise ValueError(f"kv_fill must be in (0, 1], got {self.kv_fill}")
        if not 0 <= self.min_sample_seconds <= self.max_sample_seconds or self.max_sample_seconds <= 0:
            raise ValueError("need 0 <= min_sample_seconds <= max_sample_seconds, max_sample_seconds > 0")
        if self.prefill_reps < 0 or self.weight_loads < 0 or self.max_repeats < 1 or self.timeout_s <= 0:
            raise ValueError("prefill_reps and weight_loads must be >= 0, max_repeats >= 1, timeout_s > 0")
        if self.passes < 1 or (self.trim is not None and self.trim <= 1):
            raise ValueError("passes must be >= 1 and trim > 1 (or None)")

    @property
    def decode_tokens(self) -> int:
        """Response tokens a decode point asks for when the engine does not bound it."""
        return int(1.5 * self.samples_per_point * self.steps_per_sample) + 128
