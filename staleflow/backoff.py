"""Bounded, jittered exponential backoff: how long to wait before trying a component that is down
again. Pure: the caller sleeps."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """After the n-th failure in a row wait ``min(cap, base * 2**(n-1))``, scaled by a jitter drawn
    from [1 - jitter, 1] so that callers that failed together do not retry together; a success starts
    over from ``base``."""

    def __init__(self, base: float, cap: float, jitter: float = 0.5, draw: Callable[[], float] = random.random):
        if not 0 < base <= cap:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={base}, cap={cap}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.base, self.cap, self.jitter, self._draw = base, cap, jitter, draw
        self.failures = 0

    def failed(self) -> float:
        """One more failure in a row: the seconds to wait before the next try."""
        self.failures += 1
        ceiling = min(self.cap, self.base * 2.0 ** min(self.failures - 1, 64))
        return ceiling * (1.0 - self.jitter * self._draw())

    def succeeded(self) -> None:
        self.failures = 0
