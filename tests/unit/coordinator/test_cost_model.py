"""The cost model: paper Eq. 2-4 and the closed-form multi-step sums the simulator relies on."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.cost_model import CostModel

PAPER = CostModel()


def test_defaults_are_table_4() -> None:
    assert (PAPER.k1, PAPER.k2, PAPER.k3, PAPER.k4, PAPER.k5) == (7.28e-8, 1.72e-3, 1.25e-4, 1.07e-2, 1.0)


def test_step_latency_is_eq_11_on_both_sides_of_the_gemm_knee() -> None:
    # memory-bound: k3 * n < k2 for n <= 13
    assert PAPER.step_latency(100_000, 8) == pytest.approx(7.28e-8 * 100_000 + 1.72e-3 + 1.07e-2)
    # compute-bound
    assert PAPER.step_latency(1_000_000, 128) == pytest.approx(7.28e-8 * 1_000_000 + 1.25e-4 * 128 + 1.07e-2)


def test_throughput_is_eq_2() -> None:
    assert PAPER.throughput(500_000, 0) == 0.0
    assert PAPER.throughput(500_000, 64) == pytest.approx(64 / (7.28e-8 * 500_000 + 1.25e-4 * 64 + 1.07e-2))


def test_marginal_gain_is_eq_3() -> None:
    model = CostModel(kv_budget=1_000)
    expected = model.throughput(300 + 50, 4) - model.throughput(300, 3)
    assert model.marginal_gain(300, 3, 0, 50) == pytest.approx(expected)
    assert expected > 0
    # a queue on the instance, or no room: the trajectory would wait and gains nothing
    assert model.marginal_gain(300, 3, 1, 50) == 0.0
    assert model.marginal_gain(960, 3, 0, 50) == 0.0
    assert model.runs_immediately(950, 0, 50) and not model.runs_immediately(951, 0, 50)


def test_ideal_gain_uses_k5_as_in_eq_4() -> None:
    model = CostModel(k5=2.0)
    assert model.ideal_gain(1000) == pytest.approx(1 / (model.k1 * 2.0 * 1000 + max(model.k2, model.k3) + model.k4))
    # it bounds the gain of routing to any instance for the same trajectory
    assert model.marginal_gain(0, 0, 0, 1000) == pytest.approx(model.ideal_gain(1000))
    assert model.marginal_gain(10_000, 4, 0, 1000) < model.ideal_gain(1000)


def test_decode_time_is_the_sum_of_its_steps() -> None:
    kv, n, steps = 123_456, 37, 250
    by_step = sum(PAPER.step_latency(kv + j * n, n) for j in range(steps))
    assert PAPER.decode_time(kv, n, steps) == pytest.approx(by_step, rel=1e-12)
    assert PAPER.decode_time(kv, n, 0) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    kv=st.integers(0, 3_000_000),
    n=st.integers(1, 512),
    seconds=st.floats(0, 5_000, allow_nan=False),
    k5=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_steps_within_is_the_largest_fitting_count(kv: int, n: int, seconds: float, k5: float) -> None:
    model = CostModel(k5=k5)
    steps = model.steps_within(kv, n, seconds)
    assert model.decode_time(kv, n, steps) <= seconds
    assert model.decode_time(kv, n, steps + 1) > seconds


@pytest.mark.parametrize(
    "field, value", [("k1", -1.0), ("k5", 0.0), ("kv_budget", 0.0), ("k2", math.nan)]
)
def test_invalid_coefficients_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: value})
