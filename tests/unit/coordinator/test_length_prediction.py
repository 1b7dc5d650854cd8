"""The online length predictor (staleflow.length_prediction): its invariants and that it learns."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.length_prediction import LengthPredictor

lengths = st.lists(st.integers(1, 40_000), max_size=40)


def fed(observations: list[tuple[int, int]], max_tokens: int | None = None) -> LengthPredictor:
    predictor = LengthPredictor(max_tokens=max_tokens)
    for group, length in observations:
        predictor.finished(f"g{group}", length)
    return predictor


observations = st.lists(st.tuples(st.integers(0, 4), st.integers(1, 40_000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(observations, st.integers(0, 5), st.integers(0, 50_000), st.lists(st.integers(0, 50_000), max_size=8))
def test_never_predicts_below_what_was_generated(seen, group, generated, running) -> None:
    predictor = fed(seen)
    predicted = predictor.predict(f"g{group}", generated, running)
    assert predicted >= generated
    assert predictor.remaining(f"g{group}", generated, running) >= 0
    assert all(p >= g for p, g in zip(predictor.predict_members(f"g{group}", running), running, strict=True))


@settings(max_examples=150, deadline=None)
@given(observations, st.integers(0, 5), st.integers(0, 20_480), st.integers(1, 5_000))
def test_never_predicts_beyond_the_length_limit_nor_less_the_more_was_generated(seen, group, generated, more) -> None:
    predictor = fed(seen, max_tokens=20_480)
    lower = predictor.predict(f"g{group}", generated)
    higher = predictor.predict(f"g{group}", min(generated + more, 20_480))
    assert lower <= 20_480 and higher <= 20_480
    assert higher >= lower - 1e-6 * lower


@settings(max_examples=100, deadline=None)
@given(observations, st.integers(0, 5), st.lists(st.integers(1, 50_000), min_size=1, max_size=8))
def test_running_members_only_raise_their_groups_expected_length(seen, group, running) -> None:
    predictor = fed(seen)
    without, _, _ = predictor.group_log_mean(f"g{group}")
    with_bounds, _, _ = predictor.group_log_mean(f"g{group}", running)
    assert with_bounds >= without - 1e-9


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(3.0, 9.5), min_size=2, max_size=6), st.integers(0, 2**16))
def test_converges_to_each_groups_lengths(log_medians, seed) -> None:
    """Groups of very different lengths: after a few dozen members each, every group's next member
    is predicted near that group's own mean length, not the others'."""
    rng = random.Random(seed)
    predictor = LengthPredictor()
    groups = {f"g{k}": [round(math.exp(mu + 0.2 * rng.gauss(0, 1))) for _ in range(48)]
              for k, mu in enumerate(log_medians)}
    for members in zip(*groups.values(), strict=True):  # interleaved, as completions arrive
        for group, length in zip(groups, members, strict=True):
            predictor.finished(group, length)
    for group, lengths_of_group in groups.items():
        mean = sum(lengths_of_group) / len(lengths_of_group)
        assert predictor.predict(group) == pytest.approx(mean, rel=0.15)


def test_learns_the_prior_and_beats_it_from_a_groups_first_members() -> None:
    """Log-normal groups (group spread 0.6, member spread 0.5, as no workload file says): the
    learned spreads approach the truth, and four finished members predict the rest better than
    the prior does."""
    rng = random.Random(7)
    predictor = LengthPredictor(max_tokens=20_480)
    errors, prior_errors = [], []
    for g in range(400):
        mu = math.log(5_000) + 0.6 * rng.gauss(0, 1)
        members = [min(20_480, round(math.exp(mu + 0.5 * rng.gauss(0, 1)))) for _ in range(16)]
        for k, length in enumerate(members):
            if k >= 4 and g >= 50:
                errors.append(abs(math.log(predictor.predict(f"g{g}") / length)))
                prior_errors.append(abs(math.log(predictor.predict(f"new{g}") / length)))
            predictor.finished(f"g{g}", length)
        predictor.forget_group(f"g{g}")
    _, group_var, member_var = predictor.prior()
    assert group_var == pytest.approx(0.36, abs=0.1) and member_var == pytest.approx(0.25, abs=0.06)
    assert sum(errors) < 0.8 * sum(prior_errors)


def test_a_prompt_sampled_again_starts_from_its_earlier_lengths() -> None:
    predictor = LengthPredictor()
    for k in range(200):  # a spread of prompts around 1,000 tokens
        predictor.finished(f"other{k}", 1_000 if k % 2 else 400, prompt_key=f"p{k}")
    for _ in range(8):
        predictor.finished("first", 12_000, prompt_key="hard")
    assert predictor.predict("again", prompt_key="hard") > 5 * predictor.predict("again")


def test_before_anything_finished_it_predicts_its_prior_and_refuses_bad_settings() -> None:
    predictor = LengthPredictor(initial_median=300)
    assert predictor.observed == 0
    assert 300 <= predictor.predict("g") <= 1_000
    assert predictor.predict("g", generated=5_000) > 5_000
    with pytest.raises(ValueError, match="initial_median"):
        LengthPredictor(initial_median=0)
    with pytest.raises(ValueError, match="max_tokens"):
        LengthPredictor(max_tokens=0)
