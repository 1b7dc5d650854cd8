"""The backoff the coordinator uses from a service that is down: bounded, jittered, growing, and
back to its base after a success."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.backoff import Backoff


@given(base=st.floats(0.001, 1.0), cap=st.floats(1.0, 30.0), jitter=st.floats(0.0, 0.99),
       draws=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=80))
def test_every_pause_is_within_the_bound_and_its_jitter(base: float, cap: float, jitter: float,
                                                        draws: list[float]) -> None:
    it = iter(draws)
    backoff = Backoff(base, cap, jitter, draw=lambda: next(it))
    for n in range(1, len(draws) + 1):
        ceiling = min(cap, base * 2 ** (n - 1))
        pause = backoff.failed()
        assert ceiling * (1 - jitter) - 1e-12 <= pause <= ceiling
    assert backoff.failures == len(draws)


def test_pauses_grow_to_the_cap_then_start_over_after_a_success() -> None:
    backoff = Backoff(0.05, 2.0, jitter=0.0)
    pauses = [backoff.failed() for _ in range(10)]
    assert pauses[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6] and pauses[6:] == [2.0] * 4
    backoff.succeeded()
    assert backoff.failed() == 0.05


def test_callers_that_fail_together_do_not_retry_together() -> None:
    a, b = Backoff(0.05, 2.0), Backoff(0.05, 2.0)
    assert [a.failed() for _ in range(8)] != [b.failed() for _ in range(8)]


@pytest.mark.parametrize(("base", "cap", "jitter"), [(0.0, 1.0, 0.5), (2.0, 1.0, 0.5), (0.1, 1.0, 1.0)])
def test_nonsense_settings_are_refused(base: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError):
        Backoff(base, cap, jitter)
