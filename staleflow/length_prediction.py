"""Online response-length prediction from what a coordinator can see. Pure: no I/O.

Response lengths of one prompt's samples are correlated (paper Appendix C: a group is mostly long
or mostly short), so the members of a group that finished say how long the others will be. The
model is the usual two-level log-normal one, learned online from every finished trajectory:

* ``log L = mu_group + e``, ``e ~ N(0, s²)`` (member noise), ``mu_group ~ N(m, tau²)`` (prompts);
* ``m`` and the total variance ``tau² + s²`` are running moments of every finished log-length;
  ``s²`` pools the spread of log-lengths within groups (and earlier samples of the same prompt);
* a group's ``mu`` is the normal posterior given its finished members' log-lengths and the
  lower bounds its running members give (their tokens so far: each counts as the expected log
  length above its bound, one E-step of censored EM); a prompt sampled again brings the finished
  lengths of its earlier samples.

A trajectory that generated ``g`` tokens is predicted ``E[L | L > g]`` under the log-normal of its
group's posterior (never below ``g``), capped at ``max_tokens`` when given. Nothing here reads a
workload's parameters: before anything finished the prior is ``initial_median`` with a wide spread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

_NORMAL = NormalDist()
_MIN_VARIANCE = 1e-4  # log-space floor: identical lengths still give a proper posterior


@dataclass
class _Moments:
    """Welford's running mean and variance."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def variance(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


@dataclass
class _GroupEvidence:
    """Finished log-lengths of one group (or of one prompt's earlier samples)."""

    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x


class LengthPredictor:
    """Predicts final response lengths (tokens) of running or waiting trajectories.

    ``finished(group_id, length, prompt_key)`` feeds a finished trajectory; ``predict(group_id,
    generated, running, prompt_key)`` predicts one that generated ``generated`` tokens so far, given
    the tokens so far of its group's other running members (lower bounds on their lengths).
    ``forget_group`` drops a group's evidence once nothing of it is left to predict (per-prompt
    history stays).
    """

    def __init__(self, initial_median: float = 1024.0, initial_sigma: float = 1.0,
                 max_tokens: int | None = None, max_prompts: int = 100_000):
        if initial_median <= 0 or initial_sigma <= 0:
            raise ValueError("initial_median and initial_sigma must be > 0")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_prompts = max_prompts
        self._initial = (math.log(initial_median), initial_sigma**2)
        self._all = _Moments()  # every finished log-length
        self._within = _Moments()  # deviations of a log-length from its group's mean (pooled)
        self._groups: dict[str, _GroupEvidence] = {}
        self._prompts: dict[str, _GroupEvidence] = {}

    # ------------------------------------------------------------------ learning

    def finished(self, group_id: str, length: int, prompt_key: str | None = None) -> None:
        """A trajectory of ``group_id`` finished with ``length`` response tokens."""
        x = math.log(max(1, length))
        self._all.add(x)
        evidence = self._evidence_of(group_id, prompt_key)
        widest = max(evidence, key=lambda e: e.n)
        if widest.n:
            # the spread within a group, against the mean of the members before it (scaled by
            # sqrt(n / (n + 1)): the deviation from a mean of n has variance s² (1 + 1/n))
            deviation = x - widest.total / widest.n
            self._within.add(deviation * math.sqrt(widest.n / (widest.n + 1)))
        for e in evidence:
            e.add(x)

    def _evidence_of(self, group_id: str, prompt_key: str | None) -> list[_GroupEvidence]:
        out = [self._groups.setdefault(group_id, _GroupEvidence())]
        if prompt_key is not None:
            if prompt_key not in self._prompts and len(self._prompts) >= self.max_prompts:
                self._prompts.pop(next(iter(self._prompts)))  # the oldest prompt's history goes
            out.append(self._prompts.setdefault(prompt_key, _GroupEvidence()))
        return out

    def forget_group(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    # ------------------------------------------------------------------ the model

    @property
    def observed(self) -> int:
        """Finished trajectories learned from."""
        return self._all.n

    def prior(self) -> tuple[float, float, float]:
        """``(m, tau², s²)``: the mean of group log-means, their variance, the member variance."""
        if self._all.n < 2:
            m, var = self._initial
            return (self._all.mean if self._all.n else m), var / 2, var / 2
        total = max(self._all.variance, _MIN_VARIANCE)
        member = min(self._within.variance, total) if self._within.n >= 2 else total / 2
        member = max(member, _MIN_VARIANCE)
        return self._all.mean, max(total - member, _MIN_VARIANCE), member

    def group_log_mean(self, group_id: str, running: Iterable[int] = (), prompt_key: str | None = None
                       ) -> tuple[float, float, float]:
        """The posterior of the group's log-mean ``(mean, variance)`` and the member variance."""
        m, tau2, s2 = self.prior()
        # a prompt's history holds this group's finished members too: the one with more counts
        found = [e for e in (self._groups.get(group_id), self._prompts.get(prompt_key) if prompt_key else None)
                 if e is not None]
        widest = max(found, key=lambda e: e.n) if found else _GroupEvidence()
        n, total = widest.n, widest.total
        mean, var = _posterior(m, tau2, s2, n, total)
        bounds = [math.log(g) for g in running if g > 0]
        if bounds:  # each running member lies above its bound: its expected log-length counts
            sigma = math.sqrt(var + s2)
            imputed = sum(_truncated_mean(mean, sigma, b) for b in bounds)
            mean, var = _posterior(m, tau2, s2, n + len(bounds), total + imputed)
        return mean, var, s2

    def predict(self, group_id: str, generated: int = 0, running: Iterable[int] = (),
                prompt_key: str | None = None) -> float:
        """Expected final response length of a trajectory of ``group_id`` that generated
        ``generated`` tokens so far (>= ``generated``; <= ``max_tokens`` unless it already
        generated more). ``running``: tokens so far of the group's other running members."""
        mean, var, s2 = self.group_log_mean(group_id, running, prompt_key)
        return self._bounded(mean, math.sqrt(var + s2), generated)

    def predict_members(self, group_id: str, generated: Sequence[int], prompt_key: str | None = None) -> list[float]:
        """``predict`` for several unfinished members of one group at once, each with the tokens
        so far of all of them (``generated``) as the group's lower bounds."""
        mean, var, s2 = self.group_log_mean(group_id, generated, prompt_key)
        sigma = math.sqrt(var + s2)
        expected = {g: self._bounded(mean, sigma, g) for g in set(generated)}
        return [expected[g] for g in generated]

    def _bounded(self, mean: float, sigma: float, generated: int) -> float:
        """E[L | L > generated] for log L ~ N(mean, sigma²), capped at ``max_tokens`` and never
        below ``generated``."""
        expected = _expected_above(mean, sigma, generated)
        if self.max_tokens is not None:
            expected = min(expected, self.max_tokens)
        return max(expected, float(generated))

    def remaining(self, group_id: str, generated: int = 0, running: Iterable[int] = (),
                  prompt_key: str | None = None) -> float:
        """Expected tokens still to generate (>= 0)."""
        return self.predict(group_id, generated, running, prompt_key) - generated

    def typical_length(self) -> float:
        """The median final length of a new prompt's trajectory under the current prior."""
        m, _, _ = self.prior()
        return math.exp(m)


def _posterior(m: float, tau2: float, s2: float, n: int, total: float) -> tuple[float, float]:
    """Normal posterior of a group's log-mean from ``n`` member log-lengths summing to ``total``."""
    precision = 1 / tau2 + n / s2
    return (m / tau2 + total / s2) / precision, 1 / precision


def _truncated_mean(mean: float, sigma: float, bound: float) -> float:
    """E[X | X > bound] for X ~ N(mean, sigma²) (>= bound)."""
    z = (bound - mean) / sigma
    tail = 1 - _NORMAL.cdf(z)
    if tail < 1e-12:
        return bound + sigma / max(z, 1.0)  # far in the tail: just above the bound
    return max(bound, mean + sigma * _NORMAL.pdf(z) / tail)


def _expected_above(mean: float, sigma: float, generated: int) -> float:
    """E[L | L > generated] for log L ~ N(mean, sigma²) (E[L] when nothing was generated)."""
    if generated > 0:
        return _truncated_lognormal_mean(mean, sigma, math.log(generated))
    return math.exp(min(mean + sigma * sigma / 2, 700.0))


def _truncated_lognormal_mean(mean: float, sigma: float, log_bound: float) -> float:
    """E[L | L > exp(log_bound)] for log L ~ N(mean, sigma²)."""
    bound = math.exp(log_bound)
    above = 1 - _NORMAL.cdf((log_bound - mean) / sigma)
    if above < 1e-12:
        # far in the tail: the conditional mean is just above the bound
        return bound * (1 + sigma * sigma / max(log_bound - mean, sigma * sigma))
    shifted = 1 - _NORMAL.cdf((log_bound - mean - sigma * sigma) / sigma)
    expected = math.exp(min(mean + sigma * sigma / 2, 700.0)) * shifted / above
    return max(bound, expected)
