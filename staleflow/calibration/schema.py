"""The calibration file's schema: cost coefficients, fit quality, thresholds and one entry per
(model, parallelism), and ``build_entry``, which turns a fit into an entry."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Literal

from pydantic import Field

from staleflow.calibration.fit import DecodeReport, Regime
from staleflow.config.cost import CostCoefficients
from staleflow.strict import StrictModel

FILE_FORMAT = "staleflow-calibration"
SPREAD_WARNING = 0.05  # warn about a coefficient whose bootstrap relative std exceeds this


class FitQuality(StrictModel):
    samples: int = Field(ge=0)
    grid_points: int = Field(ge=0)
    folds: int = Field(default=0, ge=0, description="cross-validation folds over grid points (0: none)")
    holdout_points: int = Field(ge=0, description="grid points predicted by a fit that did not see them")
    holdout_samples: int = Field(ge=0)
    r2: float = Field(description="step-latency r² of the shipped fit over all samples")
    mape: float = Field(description="throughput MAPE of the shipped fit over all samples (fraction)")
    max_ape: float
    holdout_r2: float | None = None
    holdout_mape: float | None = Field(default=None, description="cross-validated throughput MAPE (fraction)")
    holdout_max_ape: float | None = None
    residual_mean: float
    residual_std: float
    residual_max_abs: float
    kv_r2: float | None = Field(default=None, description="r² of the k5 fit")
    spread: dict[str, float] | None = Field(default=None, description="bootstrap relative std of k1..k4")


class Thresholds(StrictModel):
    max_mape: float = Field(default=0.15, gt=0, description="refuse above this held-out (else in-sample) throughput MAPE")
    min_r2: float = Field(default=0.90, le=1, description="refuse below this step-latency r²")


class ProfileGridInfo(StrictModel):
    n_values: list[int]
    contexts: list[int]
    samples_per_point: int


class CalibrationEntry(StrictModel):
    model: str = Field(min_length=1)
    parallelism: str = Field(min_length=1)
    engine: str
    created_at: str
    cost: CostCoefficients
    crossover_n: float | None = Field(description="k2 / k3: memory-bound below, compute-bound above")
    regime: Regime
    kv_unit: str = Field(default="token", description="the unit of the engine's snapshot kv_cache divided by k5")
    kv_bytes_per_token: float | None = None
    prefill_seconds_per_token: float | None = None
    weight_load_seconds: float | None = None
    quality: FitQuality
    thresholds: Thresholds
    ok: bool
    problems: list[str] = []
    warnings: list[str] = []
    grid: ProfileGridInfo | None = None
    wall_seconds: float | None = None
    truth: dict[str, float] | None = Field(default=None, description="sim only: the ground-truth coefficients")


class CalibrationFile(StrictModel):
    format: Literal["staleflow-calibration"] = FILE_FORMAT
    version: Literal[1] = 1
    entries: dict[str, dict[str, CalibrationEntry]] = Field(
        default_factory=dict, description="model -> parallelism -> entry"
    )


def judge(quality: FitQuality, thresholds: Thresholds) -> list[str]:
    """Why a fit is too poor to use (empty when it is fine)."""
    problems = []
    mape, where = quality.holdout_mape, "cross-validated"
    if mape is None:
        mape, where = quality.mape, "in-sample"
    if mape > thresholds.max_mape:
        problems.append(f"{where} throughput error {mape:.2%} exceeds the limit {thresholds.max_mape:.2%}")
    if quality.r2 < thresholds.min_r2:
        problems.append(f"step-latency r² {quality.r2:.3f} is below the limit {thresholds.min_r2:.3f}")
    return problems


def build_entry(
    *,
    model: str,
    parallelism: str,
    engine: str,
    report: DecodeReport,
    k5: float,
    kv_r2: float | None,
    kv_budget: float,
    thresholds: Thresholds = Thresholds(),
    prefill_seconds_per_token: float | None = None,
    weight_load_seconds: float | None = None,
    kv_bytes_per_token: float | None = None,
    kv_unit: str = "token",
    grid: ProfileGridInfo | None = None,
    extra_warnings: Sequence[str] = (),
    wall_seconds: float | None = None,
    truth: dict[str, float] | None = None,
    created_at: str | None = None,
) -> CalibrationEntry:
    """Assemble a calibration entry from the fits and judge it against ``thresholds``."""
    fit, o, h = report.fit, report.overall, report.holdout
    quality = FitQuality(
        samples=o.samples, grid_points=len({s.point for s in report.samples}),
        folds=len(set(report.folds.values())), holdout_points=report.holdout_points,
        holdout_samples=h.samples if h else 0,
        r2=o.r2, mape=o.mape, max_ape=o.max_ape,
        holdout_r2=h.r2 if h else None, holdout_mape=h.mape if h else None, holdout_max_ape=h.max_ape if h else None,
        residual_mean=o.residual_mean, residual_std=o.residual_std, residual_max_abs=o.residual_max_abs, kv_r2=kv_r2,
        spread=report.spread,
    )
    problems = judge(quality, thresholds)
    bounded = {"both": (), "compute-bound only": ("k2",), "memory-bound only": ("k2", "k3")}[fit.regime]
    loose = [f"{k} = {getattr(fit, k):.3g} is poorly determined (bootstrap ±{v:.0%}): it is a small part of the step "
             "latency, its regime has few points, or the timings are noisy" for k, v in (report.spread or {}).items()
             if v > SPREAD_WARNING and k not in bounded]
    return CalibrationEntry(
        model=model, parallelism=parallelism, engine=engine,
        created_at=created_at or datetime.now(UTC).isoformat(timespec="seconds"),
        cost=CostCoefficients(k1=fit.k1, k2=fit.k2, k3=fit.k3, k4=fit.k4, k5=k5, kv_budget=kv_budget),
        crossover_n=fit.crossover, regime=fit.regime, kv_unit=kv_unit, kv_bytes_per_token=kv_bytes_per_token,
        prefill_seconds_per_token=prefill_seconds_per_token, weight_load_seconds=weight_load_seconds,
        quality=quality, thresholds=thresholds, ok=not problems, problems=problems,
        warnings=[*fit.warnings, *loose, *extra_warnings], grid=grid, wall_seconds=wall_seconds, truth=truth,
    )
