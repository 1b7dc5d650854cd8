"""Fitting the cost model to profiled measurements: pure, no I/O.

The cost model (``staleflow.cost_model``, paper Appendix B, Eq. 11) says one decode step with ``n``
running trajectories holding ``kv`` KV units takes::

    L(kv, n) = k1 * kv + max(k2, k3 * n) + k4

The ``max`` makes it piecewise linear in ``n``: memory-bound (``k1*kv + k2 + k4``) up to the
crossover ``n* = k2 / k3``, compute-bound (``k1*kv + k3*n + k4``) beyond. Written as a hinge,
``max(k2, k3*n) = k2 + k3 * max(0, n - n*)``, so for a fixed crossover ``c`` the model is linear::

    L = k1 * kv + k3 * max(0, n - c) + b,    b = k2 + k4,  k2 = k3 * c,  k4 = b - k3 * c

``fit_step_latency`` fits that with scikit-learn (non-negative ``k1``, ``k3``) for every candidate
crossover of Hudson's exact segmented-regression search (each profiled ``n``, plus the interior
crossover of each gap between consecutive ``n`` values from an unconstrained fit) and keeps the
candidate with the smallest relative squared error. Step latencies carry multiplicative noise, so
residuals are weighted by ``1 / L^2`` (least squares on relative error; ``L`` from a first fit, one
reweighting step), times the number of decode steps a sample averages.

What is identifiable: with data on both sides of the crossover all four coefficients are. With
only memory-bound data, ``k3`` is not (it is reported 0 and ``k2 + k4`` is reported as ``k4``);
with only compute-bound data, ``k2`` is only bounded (``k2 <= k3 * n_min``; reported at the bound).
Both cases come back as warnings.

Also here: ``k5`` (KV units per token, from snapshot KV against tokens held) and the prefill cost
per token. scikit-learn is imported only by the fitting functions, so the file loader works
without the ``calibrate`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

PAPER_MAPE = 0.1052  # Appendix B.2 / Figure 24: mean estimation error of the paper's cost model


class CalibrationError(ValueError):
    """Bad input to a fit, or a calibration file / entry that cannot be used."""


# ---------------------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class DecodeSample:
    """One measurement: mean seconds per decode step with ``n`` running trajectories at ``kv``.

    ``point`` names the profiling grid point it came from (samples of one point share a running
    set); the held-out split is made by point, so held-out configurations are genuinely unseen.
    """

    n: int
    kv: float
    latency: float
    point: int = 0
    steps: float = 1.0  # decode steps averaged: the sample's weight (its variance is ~ 1 / steps)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise CalibrationError(f"a decode sample needs n >= 1 running trajectories, got {self.n}")
        if not (math.isfinite(self.kv) and self.kv >= 0):
            raise CalibrationError(f"a decode sample needs a finite kv >= 0, got {self.kv}")
        if not (math.isfinite(self.latency) and self.latency > 0):
            raise CalibrationError(f"a decode sample needs a finite step latency > 0, got {self.latency}")
        if not self.steps > 0:
            raise CalibrationError(f"a decode sample averages > 0 steps, got {self.steps}")

    @property
    def throughput(self) -> float:
        return self.n / self.latency


Regime = Literal["both", "memory-bound only", "compute-bound only"]


@dataclass(frozen=True)
class DecodeFit:
    """k1..k4 of Eq. 11 and where the crossover ``n* = k2 / k3`` fell relative to the data."""

    k1: float
    k2: float
    k3: float
    k4: float
    crossover: float | None  # k2 / k3; None when k3 is not identifiable (no compute-bound data)
    regime: Regime
    warnings: tuple[str, ...] = ()

    def step_latency(self, kv: np.ndarray | float, n: np.ndarray | float) -> np.ndarray:
        kv, n = np.asarray(kv, dtype=float), np.asarray(n, dtype=float)
        return self.k1 * kv + np.maximum(self.k2, self.k3 * n) + self.k4

    def throughput(self, kv: np.ndarray | float, n: np.ndarray | float) -> np.ndarray:
        return np.asarray(n, dtype=float) / self.step_latency(kv, n)


@dataclass(frozen=True)
class FitMetrics:
    """How well a fit predicts a set of samples."""

    samples: int
    r2: float  # of step latency
    mape: float  # mean absolute percentage error of throughput, as a fraction
    max_ape: float
    residual_mean: float  # relative latency residuals (measured - predicted) / predicted
    residual_std: float
    residual_max_abs: float


@dataclass(frozen=True)
class DecodeReport:
    """The shipped fit (on all samples) and its quality, in sample and cross-validated.

    Cross-validation is by grid point: each fold's points are predicted by a fit on the other folds,
    so ``holdout`` scores predictions of configurations the fit never saw.
    """

    fit: DecodeFit
    overall: FitMetrics  # the shipped fit on every sample
    holdout: FitMetrics | None  # out-of-fold predictions of the held-out grid points
    folds: dict[int, int]  # grid point -> fold (empty: no cross-validation)
    samples: tuple[DecodeSample, ...]
    predicted: tuple[float, ...] = field(repr=False)  # shipped fit's latency per sample
    cv_predicted: tuple[float | None, ...] = field(repr=False, default=())  # out-of-fold latency per sample
    spread: dict[str, float] | None = None  # bootstrap relative std of k1..k4 (resampling grid points)

    @property
    def holdout_points(self) -> int:
        """Grid points with an out-of-fold prediction."""
        return len({s.point for s, p in zip(self.samples, self.cv_predicted, strict=False) if p is not None})


# ---------------------------------------------------------------------------------------- decode fit


def _arrays(samples: Sequence[DecodeSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = np.array([s.n for s in samples], dtype=float)
    kv = np.array([s.kv for s in samples], dtype=float)
    y = np.array([s.latency for s in samples], dtype=float)
    return n, kv, y


def _weights(samples: Sequence[DecodeSample], y: np.ndarray) -> np.ndarray:
    """Relative least squares, each sample counting as many times as the steps it averages.

    "Relative" is to the median latency of the sample's grid point rather than to the sample itself,
    so that one spuriously fast interval does not weigh more than its neighbours.
    """
    steps = np.array([s.steps for s in samples], dtype=float)
    points = np.array([s.point for s in samples])
    scale = np.empty_like(y)
    for p in np.unique(points):
        at = points == p
        scale[at] = np.median(y[at])
    return steps / steps.mean() / scale**2


def _check_samples(samples: Sequence[DecodeSample], what: str = "the fit") -> None:
    if len(samples) < 4:
        raise CalibrationError(f"{what} needs at least 4 decode samples, got {len(samples)}")
    if len({s.n for s in samples}) < 2:
        raise CalibrationError(f"{what} needs samples at >= 2 different running counts n (k3 vs k4)")
    if len({s.kv for s in samples}) < 2:
        raise CalibrationError(f"{what} needs samples at >= 2 different KV sizes (k1)")


def _scale(x: np.ndarray) -> float:
    m = float(np.max(np.abs(x))) if x.size else 0.0
    return m if m > 0 else 1.0


def _hinge_at(n: np.ndarray, kv: np.ndarray, y: np.ndarray, w: np.ndarray, c: float) -> tuple[float, tuple[float, ...]]:
    """Best (k1, k2, k3, k4) with the crossover pinned at ``c``; returns (weighted SSE, coefficients)."""
    from sklearn.linear_model import LinearRegression

    hinge = np.maximum(n - c, 0.0)
    s_kv, s_h = _scale(kv), _scale(hinge)
    reg = LinearRegression(positive=True).fit(np.column_stack([kv / s_kv, hinge / s_h]), y, sample_weight=w)
    k1, k3 = reg.coef_[0] / s_kv, reg.coef_[1] / s_h
    b = float(reg.intercept_)
    if b - k3 * c < 0:
        # k4 would be negative: the constrained optimum has k4 = 0, i.e. L = k1*kv + k3*max(n, c)
        floor = np.maximum(n, c)
        s_f = _scale(floor)
        reg = LinearRegression(positive=True, fit_intercept=False).fit(
            np.column_stack([kv / s_kv, floor / s_f]), y, sample_weight=w
        )
        k1, k3 = reg.coef_[0] / s_kv, reg.coef_[1] / s_f
        b = k3 * c
    k1, k3 = float(k1), float(k3)
    pred = k1 * kv + k3 * hinge + b
    sse = float(np.sum(w * (y - pred) ** 2))
    return sse, (k1, k3 * c, k3, b - k3 * c)


def _interior_crossover(
    n: np.ndarray, kv: np.ndarray, y: np.ndarray, w: np.ndarray, lo: float, hi: float
) -> float | None:
    """Hudson's step: the unconstrained two-piece fit with the split between ``lo`` and ``hi``.

    Left of the split ``L = k1*kv + b``, right ``L = k1*kv + b + beta + gamma*n``; the pieces meet at
    ``-beta / gamma``, which is the optimal crossover in ``[lo, hi]`` when it lies there.
    """
    from sklearn.linear_model import LinearRegression

    right = (n > lo).astype(float)
    s_kv, s_n = _scale(kv), _scale(n)
    reg = LinearRegression().fit(np.column_stack([kv / s_kv, right, right * n / s_n]), y, sample_weight=w)
    beta, gamma = float(reg.coef_[1]), float(reg.coef_[2]) / s_n
    if gamma <= 0:
        return None
    c = -beta / gamma
    return c if lo < c < hi else None


def _search(n: np.ndarray, kv: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, tuple[float, ...]]:
    """Hudson's search: the crossover (and coefficients) with the least weighted squared error."""
    levels = np.unique(n)
    candidates = [0.0, *levels.tolist()]
    for lo, hi in zip(levels[:-1], levels[1:], strict=True):
        c = _interior_crossover(n, kv, y, w, float(lo), float(hi))
        if c is not None:
            candidates.append(c)
    best_sse, best_c, best = math.inf, 0.0, (0.0, 0.0, 0.0, 0.0)
    for c in sorted(set(candidates)):
        sse, coefs = _hinge_at(n, kv, y, w, c)
        if sse < best_sse * (1 - 1e-12):  # ties (unidentifiable ranges) keep the smaller crossover
            best_sse, best_c, best = sse, c, coefs
    return best_c, best


def fit_step_latency(samples: Sequence[DecodeSample]) -> DecodeFit:
    """Least-relative-squares fit of Eq. 11 to decode samples (see the module docstring)."""
    _check_samples(samples)
    n, kv, y = _arrays(samples)
    steps = np.array([s.steps for s in samples], dtype=float)
    steps /= steps.mean()
    # relative to the point's median first, then (one reweighting) to the first fit's prediction
    best_c, best = _search(n, kv, y, _weights(samples, y))
    k1, k2, k3, k4 = best
    predicted = k1 * kv + np.maximum(k2, k3 * n) + k4
    if np.all(predicted > 0):
        best_c, best = _search(n, kv, y, steps / predicted**2)
    k1, k2, k3, k4 = best
    levels = np.unique(n)
    n_min, n_max = float(levels[0]), float(levels[-1])
    warnings: list[str] = []
    if k3 * max(0.0, n_max - best_c) <= 1e-9 * float(np.median(y)):
        # no compute-bound point: k3 is not identifiable and k2 + k4 is one constant
        warnings.append(
            f"no compute-bound regime up to n = {n_max:g}: k3 is not identifiable (reported 0) and the "
            f"memory-bound floor k2 + k4 is reported as k4; profile larger n"
        )
        return DecodeFit(k1, 0.0, 0.0, k2 + k4, None, "memory-bound only", tuple(warnings))
    if best_c <= n_min:
        # every point is on the compute-bound line L = k1*kv + k3*n + k4: any crossover in [0, n_min]
        # predicts the same; report the largest one consistent with the data
        c, k2 = n_min, k3 * n_min
        warnings.append(
            f"compute-bound already at the smallest profiled n = {n_min:g}: the crossover n* is at or below "
            f"it and k2 is an upper bound (k2 <= k3 * {n_min:g}); predictions for n >= {n_min:g} are unaffected"
        )
        return DecodeFit(k1, k2, k3, max(k4, 0.0), c, "compute-bound only", tuple(warnings))
    return DecodeFit(k1, k2, k3, k4, k2 / k3, "both", tuple(warnings))


def metrics(samples: Sequence[DecodeSample], predicted: Sequence[float] | np.ndarray) -> FitMetrics:
    """Latency r², throughput MAPE and relative residuals of ``predicted`` latencies of ``samples``."""
    if not samples:
        raise CalibrationError("cannot score a fit on no samples")
    n, _, y = _arrays(samples)
    pred = np.asarray(predicted, dtype=float)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else (1.0 if np.allclose(y, pred) else 0.0)
    ape = np.abs(n / pred - n / y) / (n / y)
    rel = (y - pred) / pred
    return FitMetrics(
        samples=len(samples), r2=r2, mape=float(ape.mean()), max_ape=float(ape.max()),
        residual_mean=float(rel.mean()), residual_std=float(rel.std()), residual_max_abs=float(np.abs(rel).max()),
    )


def score(fit: DecodeFit, samples: Sequence[DecodeSample]) -> FitMetrics:
    """``metrics`` of ``fit``'s predictions."""
    n, kv, _ = _arrays(samples)
    return metrics(samples, fit.step_latency(kv, n))


def fold_points(samples: Sequence[DecodeSample], folds: int, seed: int = 0) -> dict[int, int]:
    """Grid point -> fold, stratified by ``n``: the points of one running count spread over the folds,
    so a fold holds out all of an ``n`` only when that ``n`` has a single point."""
    if folds < 2:
        raise CalibrationError(f"cross-validation needs >= 2 folds, got {folds}")
    by_n: dict[int, list[int]] = {}
    for s in samples:
        if s.point not in by_n.setdefault(s.n, []):
            by_n[s.n].append(s.point)
    rng = np.random.default_rng(seed)
    assignment, offset = {}, 0
    for n in sorted(by_n):
        for k, point in enumerate(rng.permutation(by_n[n]).tolist()):
            assignment[point] = (offset + k) % folds
        offset += len(by_n[n])
    return assignment


def bootstrap_spread(samples: Sequence[DecodeSample], fit: DecodeFit, rounds: int, seed: int = 0) -> dict[str, float]:
    """Relative standard deviation of k1..k4 over fits to grid points resampled with replacement."""
    by_point: dict[int, list[DecodeSample]] = {}
    for s in samples:
        by_point.setdefault(s.point, []).append(s)
    points = sorted(by_point)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(rounds):
        resampled = [s for p in rng.choice(points, size=len(points)).tolist() for s in by_point[p]]
        try:
            f = fit_step_latency(resampled)
        except CalibrationError:
            continue
        draws.append([f.k1, f.k2, f.k3, f.k4])
    if len(draws) < 2:
        return {}
    draws_arr = np.array(draws)
    std = np.std(draws_arr, axis=0, ddof=1)
    # relative to the shipped value; to the draws' mean magnitude where the shipped one is 0 (a bound)
    scale = np.maximum(np.abs([fit.k1, fit.k2, fit.k3, fit.k4]), np.abs(draws_arr).mean(axis=0))
    names = ("k1", "k2", "k3", "k4")
    return {k: float(sd / sc) if sc > 0 else 0.0 for k, sd, sc in zip(names, std, scale, strict=True)}


def fit_decode(samples: Sequence[DecodeSample], folds: int = 4, seed: int = 0, bootstrap: int = 0) -> DecodeReport:
    """Fit on all samples (shipped); cross-validate over ``folds`` folds of grid points (< 2: none).

    ``bootstrap`` > 0 also estimates how well each coefficient is determined (``spread``).
    """
    _check_samples(samples)
    fit = fit_step_latency(samples)
    assignment = fold_points(samples, folds, seed) if folds >= 2 else {}
    cv: list[float | None] = [None] * len(samples)
    for f in sorted(set(assignment.values())):
        train = [s for s in samples if assignment[s.point] != f]
        try:
            _check_samples(train, "a training fold")
        except CalibrationError:
            continue  # this fold's points stay unpredicted
        fold_fit = fit_step_latency(train)
        for i, s in enumerate(samples):
            if assignment[s.point] == f:
                cv[i] = float(fold_fit.step_latency(s.kv, s.n))
    predicted_out = [(s, p) for s, p in zip(samples, cv, strict=True) if p is not None]
    holdout = metrics([s for s, _ in predicted_out], [p for _, p in predicted_out]) if predicted_out else None
    n, kv, _ = _arrays(samples)
    return DecodeReport(
        fit=fit, overall=score(fit, samples), holdout=holdout, folds=assignment, samples=tuple(samples),
        predicted=tuple(fit.step_latency(kv, n).tolist()), cv_predicted=tuple(cv),
        spread=bootstrap_spread(samples, fit, bootstrap, seed) if bootstrap > 0 else None,
    )


# ---------------------------------------------------------------------------------------- k5, prefill


def fit_kv_footprint(pairs: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """k5 from (tokens held by running trajectories, KV the engine reports) pairs: slope through 0.

    Returns ``(k5, r2)``. The KV unit is whatever the engine's snapshot reports (tokens for vLLM,
    KV units for the simulator), which is what the coordinator feeds into the cost model.
    """
    arr = np.array([p for p in pairs if p[0] > 0], dtype=float).reshape(-1, 2)
    if len(arr) < 1:
        raise CalibrationError("k5 needs at least one snapshot with tokens held by running trajectories")
    tokens, kv = arr[:, 0], arr[:, 1]
    k5 = float(np.dot(tokens, kv) / np.dot(tokens, tokens))
    if not k5 > 0:
        raise CalibrationError(f"the engine reported no KV cache for {int(tokens.max())} tokens held (k5 = {k5})")
    ss_tot = float(np.sum((kv - kv.mean()) ** 2))
    r2 = 1.0 - float(np.sum((kv - k5 * tokens) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return k5, r2


def fit_prefill(points: Iterable[tuple[float, float]], k1: float = 0.0, k5: float = 1.0) -> float | None:
    """Prefill seconds per token from (prompt tokens, time to first token) of single trajectories.

    The first token costs the prefill plus one decode step over the freshly cached prompt, whose
    attention part ``k1 * k5`` per token is subtracted from the fitted slope. None without >= 2
    distinct prompt lengths.
    """
    arr = np.array(list(points), dtype=float).reshape(-1, 2)
    if len(np.unique(arr[:, 0])) < 2:
        return None
    from sklearn.linear_model import LinearRegression

    slope = float(LinearRegression().fit(arr[:, :1], arr[:, 1]).coef_[0])
    return max(0.0, slope - k1 * k5)
