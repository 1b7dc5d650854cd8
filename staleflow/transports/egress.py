"""A per-endpoint egress limit: a token bucket shared by every connection a server sends chunk
bodies on, so one machine can emulate a NIC of a given speed (``params.egress_gbps``, ``staleflow
bench params --link-gbps``) and a fan-out from one endpoint is bounded by that endpoint's link, as
it is between real hosts.

``TokenBucket`` is the pure rule (time comes from an injected clock). A sender asks ``reserve(n)``
before it sends ``n`` bytes and waits the seconds it answers: tokens accrue at ``rate`` bytes a
second up to ``burst`` bytes, and a reservation may take the bucket into debt, which later callers
wait out first. Senders that reserve piece by piece therefore share the rate in the order they
ask, whatever their number, and the endpoint's sum never exceeds ``rate`` beyond one ``burst``.

``EgressLimiter`` wraps a bucket for servers: ``pieces`` splits a body into ``piece_bytes`` steps
and waits before each (a thread per connection), ``apieces`` does the same for an async stream.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
DEFAULT_PIECE_BYTES = 256 << 10
"""Bytes sent per reservation: at 1 Gbit/s a piece is 2 ms of the link, so connections sharing the
endpoint interleave finely, and the per-piece overhead stays far below the copy."""


def bytes_per_s_of_gbps(gbps: float) -> float:
    if not gbps > 0:
        raise ValueError(f"an egress limit must be > 0 Gbit/s, got {gbps}")
    return gbps * GBIT


class TokenBucket:
    """``rate`` bytes a second, at most ``burst`` bytes saved up; thread-safe. ``clock``: seconds,
    monotonic (``time.monotonic`` unless a test gives its own)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0 bytes, got {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self._lock = threading.Lock()
        self.granted = 0  # bytes reserved so far

    def reserve(self, n: int) -> float:
        """Takes ``n`` bytes' tokens now and says how many seconds to wait before sending them
        (0 when the bucket held them). ``n`` may exceed ``burst``: the wait covers the debt."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} bytes")
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate)
            self._at = max(self._at, now)
            self._tokens -= n
            self.granted += n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class EgressLimiter:
    """One endpoint's egress: every body a server sends goes through ``pieces`` (threads) or
    ``apieces`` (an event loop), which wait on the shared bucket before each piece."""

    def __init__(self, bytes_per_s: float, burst_bytes: float | None = None, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if piece_bytes < 1:
            raise ValueError("piece_bytes must be >= 1")
        self.piece_bytes = piece_bytes
        # a burst of a few pieces: enough that a lone sender is never starved by timer slack,
        # small against any transfer worth measuring
        self.bucket = TokenBucket(bytes_per_s, burst_bytes or 4 * piece_bytes, clock)
        self._sleep = sleep

    @classmethod
    def of_gbps(cls, gbps: float | None, **kwargs: object) -> EgressLimiter | None:
        """The limiter for ``gbps`` Gbit/s, or None (no limit) for None."""
        return None if gbps is None else cls(bytes_per_s_of_gbps(gbps), **kwargs)  # type: ignore[arg-type]

    @property
    def bytes_per_s(self) -> float:
        return self.bucket.rate

    def wait_for(self, n: int) -> None:
        """Blocks until ``n`` more bytes may leave this endpoint."""
        delay = self.bucket.reserve(n)
        if delay > 0:
            self._sleep(delay)  # pacing the link, not synchronisation

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """``[start, end)`` as (offset, end) steps of at most ``piece_bytes``, each once the
        bucket allows it."""
        while start < end:
            stop = min(end, start + self.piece_bytes)
            self.wait_for(stop - start)
            yield start, stop
            start = stop

    async def apieces(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``body``'s pieces, re-cut to at most ``piece_bytes`` and each let through once the
        bucket allows it (the event loop sleeps, not the thread)."""
        async for piece in body:
            if len(piece) <= self.piece_bytes:
                delay = self.bucket.reserve(len(piece))
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the link
                yield piece
                continue
            with memoryview(piece) as view:
                for at in range(0, len(view), self.piece_bytes):
                    part = view[at:at + self.piece_bytes]
                    delay = self.bucket.reserve(len(part))
                    if delay > 0:
                        await asyncio.sleep(delay)  # pacing the link
                    yield bytes(part)
