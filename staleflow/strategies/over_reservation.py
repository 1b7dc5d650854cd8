"""Speculative over-reservation sized by the predicted tail (paper §4.3, Appendix C, made adaptive).

Batch redundancy lets the ledger admit ``C > B`` groups per buffer window; the first ``B`` to be
occupied fill the buffer and the rest are aborted as surplus. It pays when a buffer would
otherwise wait for a long tail (a few long groups), and costs the surplus's tokens when it would
not. So the extra groups are reserved only while the tail is predicted long: the longest
predicted remainder among the unfinished members of the groups the next buffer waits for, over a
typical trajectory's length (``LengthPredictor``). Up to ``tail_threshold`` none are reserved, from
twice that on all ``C - B`` of them, a proportional share in between.

The strategies withhold the unused part from the ledger's admission table: a group of version
``v`` may use the buffers ``t .. v + eta`` (``t``, the trainer's version, is the newest key of the
table), so a ledger of capacity ``C - unused`` would admit ``unused x (v + eta - t + 1)`` fewer of
them (exactly so at ``v = t``, where new groups start; at most that many fewer at older versions).
Pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def predicted_tail(remainders: Iterable[float], typical_length: float) -> float:
    """The longest predicted remainder (tokens) over a typical trajectory's length (0: nothing left)."""
    if typical_length <= 0:
        raise ValueError(f"typical_length must be > 0, got {typical_length}")
    return max(remainders, default=0.0) / typical_length


def extra_groups(tail: float, surplus_capacity: int, tail_threshold: float) -> int:
    """How many of the ledger's ``surplus_capacity`` extra groups per buffer to use for a tail of
    ``tail`` (``predicted_tail``)."""
    if surplus_capacity < 0:
        raise ValueError(f"surplus_capacity must be >= 0, got {surplus_capacity}")
    if tail_threshold <= 0:
        raise ValueError(f"tail_threshold must be > 0, got {tail_threshold}")
    share = min(1.0, max(0.0, tail / tail_threshold - 1.0))
    return math.ceil(surplus_capacity * share - 1e-9)


def spare_admission(admission: Mapping[int, int], eta: int, unused_per_buffer: int) -> dict[int, int]:
    """The ledger's admission table less the ``unused_per_buffer`` extra groups of every buffer a
    version's groups may use."""
    if unused_per_buffer < 0:
        raise ValueError(f"unused_per_buffer must be >= 0, got {unused_per_buffer}")
    if not admission or not unused_per_buffer:
        return dict(admission)
    t = max(admission)
    return {v: max(0, n - unused_per_buffer * (v + eta - t + 1)) for v, n in admission.items()}
