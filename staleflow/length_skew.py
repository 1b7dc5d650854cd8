"""What enforcing the staleness bound did to the response lengths, per training step. Pure: it is
fed events (a trajectory ended generation, its fate, a batch consumed, a group admitted, tokens
lost to a failure) and keeps counts; no I/O, no clock (times come with the events).

The trajectory book (``staleflow.trajectory_book``, the trajectory server's state machine) and the
cluster simulation feed the same ``LengthSkew``, so a live job and ``staleflow bench systems``
report the same numbers.

Lengths are counted in fixed power-of-two buckets that suit any maximum length: bucket 0 holds
empty responses and bucket ``k >= 1`` the lengths ``2**(k-1) .. 2**k - 1`` (1, 2-3, 4-7, 8-15, ...).

Every trajectory that generated anything is counted once in ``generated``, by the length it
reached, when it leaves generation: a completion by its response length, one cut while it ran
(or waited with a partial response) by what it held then. Each then gets one fate:

* ``trained``: consumed in a batch (with its staleness ``V_buf`` minus the oldest version among its segments);
* ``aborted``: its group was aborted by the staleness bound (expired before it could be consumed);
* ``filtered``: its group was filtered (all rewards equal);
* ``dropped``: surplus of redundancy (a member beyond the group's ``G``, a group beyond the batch).

So, per bucket and over the run: ``generated = trained + aborted + filtered + dropped + in flight``
(in flight: generated, fate not yet known). Per step, what ended generation during the step sits
next to what the step trained; the step's window runs from the previous batch's consumption to
its own. Besides: tokens regenerated after an instance failure (what a trajectory had generated
beyond its last checkpoint), by the bucket of the length it had reached, and how long groups waited
to be admitted (sampled until the ledger reserved them).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import accumulate
from typing import Any


class TrajectoryFate(StrEnum):
    TRAINED = "trained"
    ABORTED = "aborted"
    FILTERED = "filtered"
    DROPPED = "dropped"


FATES = tuple(TrajectoryFate)


def bucket_of(length: int) -> int:
    """The bucket of a response length: 0 for an empty one, else ``k`` with ``2**(k-1) <= length < 2**k``."""
    if length < 0:
        raise ValueError(f"a response length is >= 0, got {length}")
    return int(length).bit_length()


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """The lengths bucket ``bucket`` holds, both ends included."""
    return (0, 0) if bucket == 0 else (1 << (bucket - 1), (1 << bucket) - 1)


def bucket_label(bucket: int) -> str:
    low, high = bucket_bounds(bucket)
    return str(low) if low == high else f"{low}-{high}"


def mean_length(lengths: Mapping[int, int]) -> float | None:
    """The mean of a length histogram (length -> count); None when it is empty."""
    n = sum(lengths.values())
    return sum(k * c for k, c in lengths.items()) / n if n else None


def _cdf(lengths: Mapping[int, int], points: list[int]) -> list[float]:
    n = sum(lengths.values())
    keys = sorted(lengths)
    running = list(accumulate(lengths[k] for k in keys))
    return [running[i - 1] / n if (i := bisect_right(keys, x)) else 0.0 for x in points]


def ks_distance(a: Mapping[int, int], b: Mapping[int, int]) -> float | None:
    """Kolmogorov-Smirnov distance between two length histograms: the largest gap between their
    CDFs (0: the same distribution, 1: disjoint). None when either is empty."""
    if not sum(a.values()) or not sum(b.values()):
        return None
    points = sorted(set(a) | set(b))
    return max(abs(x - y) for x, y in zip(_cdf(a, points), _cdf(b, points), strict=True))


def wasserstein_distance(a: Mapping[int, int], b: Mapping[int, int]) -> float | None:
    """Earth mover's (Wasserstein-1) distance between two length histograms, in tokens: the area
    between their CDFs. None when either is empty."""
    if not sum(a.values()) or not sum(b.values()):
        return None
    points = sorted(set(a) | set(b))
    ca, cb = _cdf(a, points), _cdf(b, points)
    return sum(abs(ca[i] - cb[i]) * (points[i + 1] - points[i]) for i in range(len(points) - 1))


@dataclass
class AdmissionWaits:
    """How many admitted groups waited (a wait of 0: admitted as it was sampled), and for how long:
    a tally, so that it costs the same however many groups it counts."""

    admitted: int = 0
    waited: int = 0
    wait_s: float = 0.0  # the waits added up
    max_wait_s: float = 0.0

    def count(self, wait_s: float) -> None:
        self.admitted += 1
        if wait_s > 0:
            self.waited += 1
            self.wait_s += wait_s
            self.max_wait_s = max(self.max_wait_s, wait_s)

    def add(self, other: AdmissionWaits) -> None:
        self.admitted += other.admitted
        self.waited += other.waited
        self.wait_s += other.wait_s
        self.max_wait_s = max(self.max_wait_s, other.max_wait_s)

    def to_json(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "waited": self.waited,
                "mean_wait_s": self.wait_s / self.waited if self.waited else 0.0, "max_wait_s": self.max_wait_s}


@dataclass
class StepSkew:
    """One training step's window: what ended generation in it, what it trained, what was cut."""

    step: int
    generated: Counter[int] = field(default_factory=Counter[int])  # bucket -> trajectories
    fates: dict[TrajectoryFate, Counter[int]] = field(default_factory=lambda: {f: Counter() for f in TrajectoryFate})
    staleness: dict[int, Counter[int]] = field(default_factory=dict[int, Counter[int]])  # bucket -> {staleness: trained}
    regenerated: Counter[int] = field(default_factory=Counter[int])  # bucket -> trajectories resumed after a failure
    regenerated_tokens: Counter[int] = field(default_factory=Counter[int])  # bucket -> tokens generated again
    admission: AdmissionWaits = field(default_factory=AdmissionWaits)  # how long admitted groups waited
    generated_tokens: int = 0
    trained_tokens: int = 0

    def add(self, other: StepSkew) -> None:
        """Add ``other``'s counts to this window's."""
        self.generated.update(other.generated)
        for f in TrajectoryFate:
            self.fates[f].update(other.fates[f])
        for b, hist in other.staleness.items():
            self.staleness.setdefault(b, Counter()).update(hist)
        self.regenerated.update(other.regenerated)
        self.regenerated_tokens.update(other.regenerated_tokens)
        self.admission.add(other.admission)
        self.generated_tokens += other.generated_tokens
        self.trained_tokens += other.trained_tokens

    def violations(self, eta: int) -> int:
        """Trained trajectories whose staleness lies outside ``[0, eta]`` (must be none)."""
        return sum(n for hist in self.staleness.values() for k, n in hist.items() if not 0 <= k <= eta)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, **_counts_json(self.generated, self.fates, self.staleness, self.regenerated,
                                                  self.regenerated_tokens),
                "generated_tokens": self.generated_tokens, "trained_tokens": self.trained_tokens,
                "generated_mean": self.generated_tokens / n if (n := sum(self.generated.values())) else None,
                "trained_mean": self.trained_tokens / n if (n := sum(self.fates[TrajectoryFate.TRAINED].values())) else None,
                "admission": self.admission.to_json()}


def _labelled(counts: Mapping[int, float]) -> dict[str, float]:
    return {bucket_label(k): counts[k] for k in sorted(counts) if counts[k]}


def _counts_json(generated: Counter[int], fates: Mapping[TrajectoryFate, Counter[int]], staleness: Mapping[int, Counter[int]],
                 regenerated: Counter[int], regenerated_tokens: Counter[int]) -> dict[str, Any]:
    return {"generated": _labelled(generated), **{f.value: _labelled(fates[f]) for f in TrajectoryFate},
            "staleness_mean": {bucket_label(b): sum(k * n for k, n in hist.items()) / sum(hist.values())
                               for b, hist in sorted(staleness.items()) if sum(hist.values())},
            "regenerated": _labelled(regenerated), "regenerated_tokens": _labelled(regenerated_tokens)}


WINDOWS_KEPT = 1_000
"""The newest steps whose windows a ``LengthSkew`` keeps (some 5 KiB each): older ones leave memory,
their counts stay in the totals (each window went to the tracker's step metrics as its step ended)."""


class LengthSkew:
    """The accounting of one run (a trajectory server since it started, or a simulated job).

    Events name trajectories by id; an event about a trajectory the accounting does not hold (one
    generated before a restart of the server, or already settled) changes nothing, so a transition
    replayed or redelivered is not counted twice."""

    def __init__(self, windows_kept: int = WINDOWS_KEPT) -> None:
        if windows_kept < 1:
            raise ValueError(f"windows_kept must be >= 1, got {windows_kept}")
        self.windows_kept = windows_kept
        self._kept_from = 0  # windows of steps before it were let go
        self.step = 0  # the window events go to: the buffer consumed next
        self._step_known = False  # False until a consumption says which step this is (a server may start late)
        self.steps: dict[int, StepSkew] = {}
        # every window added up, kept as the events come: what is read on every health probe and
        # step record must not cost the number of steps so far
        self._total = StepSkew(-1)
        self._open: dict[str, int] = {}  # traj_id -> length: generated, fate not known yet
        self._sampled: dict[str, float] = {}  # group_id -> when it was sampled, until admitted
        self._cutting: dict[str, TrajectoryFate] = {}  # traj_id -> its fate, while its instance aborts it
        self.generated_lengths: Counter[int] = Counter()  # length -> trajectories (the whole run)
        self.trained_lengths: Counter[int] = Counter()

    def _window(self, step: int | None = None) -> StepSkew:
        step = self.step if step is None else step
        window = self.steps.get(step)
        if window is None:
            window = self.steps[step] = StepSkew(step)
        return window

    def _windows(self, step: int | None = None) -> tuple[StepSkew, StepSkew]:
        """The step's window and the run's total: every count goes to both."""
        return self._window(step), self._total

    # -- events

    def generated(self, traj_id: str, length: int) -> None:
        """A trajectory finished generation with ``length`` response tokens; its fate comes later."""
        if traj_id in self._open:
            return
        self._count_generated(length)
        self._open[traj_id] = length

    def _count_generated(self, length: int) -> None:
        for window in self._windows():
            window.generated[bucket_of(length)] += 1
            window.generated_tokens += length
        self.generated_lengths[length] += 1

    def settle(self, traj_id: str, fate: TrajectoryFate) -> bool:
        """A generated trajectory's fate other than training (see ``consumed``); False if unknown."""
        length = self._open.pop(traj_id, None)
        if length is None:
            return False
        for window in self._windows():
            window.fates[fate][bucket_of(length)] += 1
        return True

    def settle_all(self, traj_ids: Iterable[str], fate: TrajectoryFate) -> None:
        for traj_id in traj_ids:
            self.settle(traj_id, fate)

    def stopped(self, traj_id: str, length: int, fate: TrajectoryFate) -> None:
        """A trajectory cut before it finished, holding ``length`` response tokens: generated and
        settled at once. One that generated nothing is not counted (nothing was spent on it); one
        already generated is only settled."""
        if self.settle(traj_id, fate) or length <= 0:
            return
        self._count_generated(length)
        for window in self._windows():
            window.fates[fate][bucket_of(length)] += 1

    def cutting(self, traj_id: str, fate: TrajectoryFate) -> None:
        """A running trajectory is being aborted on its instance, with this fate; ``cut`` counts it
        once the length it reached is known."""
        self._cutting[traj_id] = fate

    def cut(self, traj_id: str, length: int) -> None:
        """A trajectory being aborted (``cutting``) stopped at ``length`` tokens."""
        fate = self._cutting.pop(traj_id, None)
        if fate is not None:
            self.stopped(traj_id, length, fate)

    def consumed(self, buffer: int, trained: Iterable[tuple[str, int]]) -> None:
        """Buffer ``buffer`` was consumed with these (traj_id, staleness: ``V_buf`` minus its oldest segment version): they
        are trained in step ``buffer``, whose window closes; later events go to ``buffer + 1``.
        What came before the first consumption seen belongs to that consumption's step."""
        if not self._step_known:
            self._step_known = True
            self._kept_from = buffer  # a server that started late has no window before it
            early = self.steps.pop(self.step, None)
            if early is not None:
                self._window(buffer).add(early)
        windows = self._windows(buffer)
        for traj_id, staleness in trained:
            length = self._open.pop(traj_id, None)
            if length is None:
                continue
            bucket = bucket_of(length)
            for window in windows:
                window.fates[TrajectoryFate.TRAINED][bucket] += 1
                window.staleness.setdefault(bucket, Counter())[staleness] += 1
                window.trained_tokens += length
            self.trained_lengths[length] += 1
        self.step = max(self.step, buffer + 1)
        for old in range(self._kept_from, self.step - self.windows_kept):
            self.steps.pop(old, None)
        self._kept_from = max(self._kept_from, self.step - self.windows_kept)

    def regenerated(self, length: int, tokens: int) -> None:
        """A trajectory that had reached ``length`` response tokens on a failed instance resumes
        elsewhere and generates ``tokens`` of them again (those beyond its last checkpoint)."""
        if tokens <= 0:
            return
        for window in self._windows():
            window.regenerated[bucket_of(length)] += 1
            window.regenerated_tokens[bucket_of(length)] += tokens

    def sampled(self, group_ids: Iterable[str], at: float) -> None:
        """New groups, sampled at ``at``: they wait for the ledger to admit them."""
        for group_id in group_ids:
            self._sampled.setdefault(group_id, at)

    def admitted(self, group_id: str, at: float) -> None:
        """The ledger admitted (reserved) a group sampled earlier: it waited from then to ``at``."""
        since = self._sampled.pop(group_id, None)
        if since is not None:
            for window in self._windows():
                window.admission.count(max(0.0, at - since))

    def forget_group(self, group_id: str) -> None:
        """A group that leaves without being admitted (aborted while sampled)."""
        self._sampled.pop(group_id, None)

    # -- reading

    def in_flight(self) -> Counter[int]:
        """Generated trajectories whose fate is not known yet, by bucket."""
        return Counter(bucket_of(n) for n in self._open.values())

    def totals(self) -> StepSkew:
        """Every window added up (``step`` -1); read-only, kept up to date as events come."""
        return self._total

    def settled_lengths(self) -> Counter[int]:
        """The lengths of the generated trajectories whose fate is known (trained or cut)."""
        return self.generated_lengths - Counter(self._open.values())

    def to_json(self, after_step: int = -1) -> dict[str, Any]:
        """The run's totals, the distances between the trained lengths and those of every generated
        trajectory whose fate is known (so what is still in flight at the end, typically the
        long ones, does not count as skew), and each step after ``after_step``."""
        total = self.totals().to_json()
        del total["step"]
        settled = self.settled_lengths()
        generated_mean = mean_length(settled)
        trained_mean = mean_length(self.trained_lengths)
        return {
            "buckets": "powers of two: bucket 0 is empty responses, bucket k holds lengths 2^(k-1) .. 2^k - 1",
            **total,
            "in_flight": _labelled(self.in_flight()),
            "trained_over_generated_mean": trained_mean / generated_mean if trained_mean and generated_mean else None,
            "ks_distance": ks_distance(self.trained_lengths, settled),
            "wasserstein_tokens": wasserstein_distance(self.trained_lengths, settled),
            "generated_lengths": {str(k): n for k, n in sorted(self.generated_lengths.items())},
            "trained_lengths": {str(k): n for k, n in sorted(self.trained_lengths.items())},
            "per_step": [self.steps[s].to_json() for s in sorted(self.steps) if s > after_step],
        }
