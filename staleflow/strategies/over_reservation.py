"""Speculative over-reservation sized by the predicted tail (paper §4.3, Appendix C, made adaptive).

Batch redundancy lets the ledger admit ``C > B`` groups per buffer window; the first ``B`` to be
occupied fill the buffer and the rest are aborted as surplus. It pays when a buffer would
otherwise wait for a long tail (a few long groups), and costs the surplus's tokens when it would
not. So the extra groups are reserved only while the tail is predicted long: the longest
predicted remainder among the unfinished members of the groups the next buffer waits for, over a
typical trajectory's length (``LengthPredictor``). At or below 1x none are reserved, from
``tail_threshold`` on all of them, a proportional share in between. Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def predicted_tail(remainders: Iterable[float], typical_length: float) -> float:
    """The longest predicted remainder (tokens) over a typical trajectory's length (0: nothing left)."""
    if typical_length <= 0:
        raise ValueError(f"typical_length must be > 0, got {typical_length}")
    return max(remainders, default=0.0) / typical_length


def extra_groups(tail: float, surplus_capacity: int, tail_threshold: float) -> int:
    """How many of the ledger's ``surplus_capacity`` extra groups to keep reserved for a tail of
    ``tail`` (``predicted_tail``)."""
    if surplus_capacity < 0:
        raise ValueError(f"surplus_capacity must be >= 0, got {surplus_capacity}")
    if tail_threshold <= 1:
        raise ValueError(f"tail_threshold must be > 1, got {tail_threshold}")
    share = min(1.0, max(0.0, (tail - 1.0) / (tail_threshold - 1.0)))
    return math.ceil(surplus_capacity * share - 1e-9)


def reservation_cap(live_groups: int, batch_size: int, eta: int, surplus_capacity: int, tail: float,
                    tail_threshold: float) -> int:
    """New groups a cycle may reserve: ``(eta + 1) x B`` plus the extra groups the tail calls for,
    less the groups already reserved or occupied and not consumed (``live_groups``)."""
    wanted = (eta + 1) * batch_size + extra_groups(tail, surplus_capacity, tail_threshold)
    return max(0, wanted - live_groups)
