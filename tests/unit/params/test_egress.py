"""The per-endpoint egress limit's token bucket, on an injected clock (no sleeps)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.transports.egress import GBIT, EgressLimiter, TokenBucket, bytes_per_s_of_gbps


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_full_bucket_lets_its_burst_through_then_paces_at_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=100.0, burst=50.0, clock=clock)
    assert bucket.reserve(50) == 0.0
    assert bucket.reserve(100) == pytest.approx(1.0)  # 100 bytes of debt at 100 bytes/s
    assert bucket.reserve(100) == pytest.approx(2.0)  # queued behind the first
    clock.now = 2.0  # the debt is paid: empty, not negative
    assert bucket.reserve(10) == pytest.approx(0.1)


def test_idle_time_refills_no_more_than_the_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, burst=20.0, clock=clock)
    bucket.reserve(20)
    clock.now = 100.0  # 1000 bytes' worth of time, but the bucket holds 20
    assert bucket.reserve(20) == 0.0
    assert bucket.reserve(10) == pytest.approx(1.0)


def test_a_clock_that_steps_back_gives_no_tokens() -> None:
    clock = FakeClock()
    clock.now = 5.0
    bucket = TokenBucket(rate=10.0, burst=10.0, clock=clock)
    bucket.reserve(10)
    clock.now = 4.0
    assert bucket.reserve(10) == pytest.approx(1.0)


@pytest.mark.parametrize("rate, burst", [(0, 1), (-1, 1), (1, 0)])
def test_a_bucket_needs_a_positive_rate_and_burst(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


def test_gbps_are_bytes_per_second_over_eight() -> None:
    assert bytes_per_s_of_gbps(1) == GBIT == 125e6
    assert EgressLimiter.of_gbps(None) is None
    assert EgressLimiter.of_gbps(8).bytes_per_s == 1e9
    with pytest.raises(ValueError):
        bytes_per_s_of_gbps(0)


@given(st.lists(st.tuples(st.floats(0, 2.0), st.integers(0, 5000)), min_size=1, max_size=60),
       st.floats(1.0, 1e4), st.floats(1.0, 1e4))
def test_what_leaves_never_exceeds_the_burst_plus_the_rate(events: list[tuple[float, int]], rate: float,
                                                            burst: float) -> None:
    """Senders reserve at arbitrary (non-decreasing) times and send when told: by any moment T,
    the bytes sent are at most burst + rate x T. And nobody waits when the bucket could pay."""
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock)
    departures = []
    for gap, n in events:
        clock.now += gap
        delay = bucket.reserve(n)
        assert delay >= 0
        departures.append((clock.now + delay, n))
    for moment, _ in departures:
        sent = sum(n for t, n in departures if t <= moment + 1e-9)
        assert sent <= burst + rate * moment + 1e-6 * max(1.0, sent)
    assert bucket.granted == sum(n for _, n in events)


def test_the_limiter_cuts_a_body_into_pieces_and_sleeps_each_ones_wait() -> None:
    clock = FakeClock()
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    limiter = EgressLimiter(1000.0, burst_bytes=100, piece_bytes=100, clock=clock, sleep=sleep)
    steps = list(limiter.pieces(50, 450))
    assert steps == [(50, 150), (150, 250), (250, 350), (350, 450)]
    assert slept == pytest.approx([0.1, 0.1, 0.1])  # the first piece was in the bucket
    assert clock.now == pytest.approx(0.3)  # 400 bytes at 1000 bytes/s, less the 100-byte burst


def test_the_async_limiter_recuts_large_pieces_and_keeps_every_byte() -> None:
    clock = FakeClock()
    limiter = EgressLimiter(1e12, burst_bytes=1e12, piece_bytes=4, clock=clock)

    async def body():
        for piece in (b"abcdefghij", b"kl", b"", b"mnopq"):
            yield piece

    async def collect() -> list[bytes]:
        return [piece async for piece in limiter.apieces(body())]

    pieces = asyncio.run(collect())
    assert b"".join(pieces) == b"abcdefghijklmnopq"
    assert max(len(p) for p in pieces) <= 4
    assert limiter.bucket.granted == 17
