"""The trainer's learning-rate schedule: warm-up, then constant or decayed to a floor."""

from __future__ import annotations

import itertools
import math

import pytest

from staleflow.config import AlgorithmConfig
from staleflow.training.schedule import learning_rate


def rates(total: int, **settings: object) -> list[float]:
    cfg = AlgorithmConfig(**settings)
    return [learning_rate(cfg, step, total) for step in range(total)]


def test_constant_without_warmup_is_the_configured_rate() -> None:
    assert rates(5, lr=1e-3) == [1e-3] * 5


def test_warmup_rises_linearly_to_the_peak_and_never_starts_at_zero() -> None:
    got = rates(6, lr=1e-3, lr_warmup_steps=3)
    assert got[:3] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3])
    assert got[3:] == pytest.approx([1e-3] * 3)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_runs_from_the_peak_after_warmup_to_the_floor_at_the_last_step(decay: str) -> None:
    got = rates(12, lr=1e-3, lr_warmup_steps=2, lr_decay=decay, lr_min_ratio=0.1)
    assert got[2] == pytest.approx(1e-3)
    assert got[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in itertools.pairwise(got[2:]))  # never rises after the peak


def test_cosine_midpoint_is_halfway_between_peak_and_floor() -> None:
    got = rates(11, lr=2.0, lr_decay="cosine", lr_min_ratio=0.0)  # steps 0..10: the middle is step 5
    assert got[5] == pytest.approx(1.0)
    assert got[0] == pytest.approx(2.0) and got[10] == pytest.approx(0.0, abs=1e-12)


def test_steps_past_the_planned_end_keep_the_floor() -> None:
    cfg = AlgorithmConfig(lr=1.0, lr_decay="linear", lr_min_ratio=0.2)
    assert learning_rate(cfg, 50, 10) == pytest.approx(0.2)


def test_a_one_step_job_trains_at_the_peak() -> None:
    cfg = AlgorithmConfig(lr=1.0, lr_decay="cosine")
    assert math.isclose(learning_rate(cfg, 0, 1), 1.0)


def test_schedule_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        AlgorithmConfig(lr_decay="exponential")
    with pytest.raises(ValueError):
        AlgorithmConfig(lr_min_ratio=1.5)
    with pytest.raises(ValueError):
        AlgorithmConfig(lr_warmup_steps=-1)
