"""How fast each instance really decodes, against what the cost model predicts for it.

The cost model is the same for every instance of a kind; a straggler (a slower GPU, a noisy
neighbour, thermal throttling) decodes slower than it predicts. An engine that reports its decode
steps and their seconds (``EngineSnapshot.decode_steps`` / ``decode_seconds``) shows it: between
two snapshots, the cost model's step latency at the instance's load times the steps, over the
seconds they took, is its speed (1.0: as modelled, 0.5: every step takes twice as long). Pure
arithmetic over snapshots, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from staleflow.cost_model import CostModel


@dataclass
class _Mark:
    steps: int
    seconds: float
    kv_cache: float
    n_running: int


class DecodeSpeeds:
    """Per instance, an exponential moving average of its decode speed over snapshot intervals.

    ``weight``: the share of a new interval in the average. ``min_steps``: an interval with fewer
    decode steps is merged into the next one (a few steps say little). An instance not seen over
    ``min_steps`` steps yet has speed 1.0 (as modelled).
    """

    def __init__(self, weight: float = 0.3, min_steps: int = 8):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be within (0, 1], got {weight}")
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        self.weight = weight
        self.min_steps = min_steps
        self._marks: dict[str, _Mark] = {}
        self._speeds: dict[str, float] = {}

    def observe(self, instance_id: str, decode_steps: int | None, decode_seconds: float | None,
                kv_cache: float, n_running: int, cost: CostModel) -> float:
        """Take in one snapshot's counters; returns the instance's speed estimate."""
        if decode_steps is None or decode_seconds is None:
            return self.speed(instance_id)
        mark = _Mark(decode_steps, decode_seconds, kv_cache, n_running)
        last = self._marks.get(instance_id)
        if last is None or decode_steps < last.steps or decode_seconds < last.seconds:  # new or restarted engine
            self._marks[instance_id] = mark
            return self.speed(instance_id)
        steps, seconds = decode_steps - last.steps, decode_seconds - last.seconds
        if steps < self.min_steps:
            return self.speed(instance_id)
        self._marks[instance_id] = mark
        # the load it decoded at: the mean of both ends' (an end with nothing running did not decode)
        ends = [cost.step_latency(m.kv_cache, m.n_running) for m in (last, mark) if m.n_running > 0]
        if not ends or seconds <= 0:
            return self.speed(instance_id)
        sample = steps * (sum(ends) / len(ends)) / seconds
        old = self._speeds.get(instance_id)
        self._speeds[instance_id] = sample if old is None else old + self.weight * (sample - old)
        return self._speeds[instance_id]

    def speed(self, instance_id: str) -> float:
        return self._speeds.get(instance_id, 1.0)

    def forget(self, instance_id: str) -> None:
        self._marks.pop(instance_id, None)
        self._speeds.pop(instance_id, None)
