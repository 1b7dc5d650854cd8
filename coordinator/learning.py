"""What the live coordinator learns from the job as it runs, and what it decided from it. Pure: no I/O.

* Response lengths: the trajectory server's feed of finished lengths (``GET /v1/finished-lengths``,
  each completion once, by an id cursor) trains a ``LengthPredictor`` per group and per prompt, as
  the simulator's coordinator learns from its completions (``staleflow.simulation.length_views``).
  Length-aware routing then orders waiting work by each trajectory's predicted remainder, and
  adaptive redundancy withholds the ledger's extra groups while the predicted tail is short. The
  cursor lives here, in memory: a restarted coordinator starts with an empty predictor and reads
  the feed from the start of what the server kept, so nothing is counted twice; a restarted
  trajectory server keeps its ids (they are in its database), and one started on another database
  has another epoch, whose feed is followed from its start.
* Pull decisions: each ``pull: auto`` choice with the inputs it was made from (every planned
  instance's decode counters, the speed they gave and its load), so what decided it can be read
  back (``GET /v1/learning``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from staleflow.api.trajectories import FinishedLengthsOut
from staleflow.config.strategy import StrategyConfig
from staleflow.length_prediction import LengthPredictor
from staleflow.strategies import PendingTrajectory
from staleflow.strategies.over_reservation import extra_groups, predicted_tail, spare_admission


class LearnedLengths:
    """The coordinator's length predictor and its place in the trajectory server's feed."""

    def __init__(self, max_tokens: int | None = None):
        self.predictor = LengthPredictor(max_tokens=max_tokens)
        self.epoch: str | None = None
        self.cursor = 0  # the id of the last finished length learned
        self.skipped = 0  # lengths the feed had pruned before they were read
        self.tail: float | None = None  # adaptive redundancy: the last predicted tail, over a typical length
        self.withheld = 0  # adaptive redundancy: groups withheld from the last admission table
        self._groups: set[str] = set()  # groups the predictor holds evidence of

    def take(self, page: FinishedLengthsOut) -> int:
        """Learn one page of the feed, read after ``cursor``; returns the lengths learned. A page
        of another epoch answered a cursor that means nothing there: it is dropped and the feed
        is followed from its start."""
        if self.epoch is not None and page.epoch != self.epoch:
            self.epoch, self.cursor = page.epoch, 0
            return 0
        self.epoch = page.epoch
        for finished in page.lengths:
            if finished.id <= self.cursor:
                continue  # never twice, whatever a server answers
            self.predictor.finished(finished.group_id, finished.length, finished.prompt_key)
            self._groups.add(finished.group_id)
            self.cursor = finished.id
        self.skipped += page.skipped
        return len(page.lengths)

    def with_remainders(self, trajectories: Sequence[PendingTrajectory], generated: Mapping[str, int],
                        prompt_keys: Mapping[str, str | None]) -> list[PendingTrajectory]:
        """``trajectories`` (waiting or on instances: every unfinished one the coordinator knows of)
        with each one's predicted remainder. ``generated``: response tokens of each so far (an
        instance's last snapshot where it runs); each group's unfinished members bound its length
        from below (``LengthPredictor.predict_members``); ``prompt_keys``: each group's prompt."""
        members: dict[str, list[PendingTrajectory]] = {}
        for t in trajectories:
            members.setdefault(t.group_id, []).append(t)
        remaining: dict[str, float] = {}
        for group_id, group in members.items():
            done = [generated.get(t.traj_id, 0) for t in group]
            predicted = self.predictor.predict_members(group_id, done, prompt_keys.get(group_id))
            remaining.update({t.traj_id: p - g for t, p, g in zip(group, predicted, done, strict=True)})
        return [replace(t, remaining=remaining[t.traj_id]) for t in trajectories]

    def spare_admission(self, admission: Mapping[int, int], predicted: Sequence[PendingTrajectory],
                        config: StrategyConfig, eta: int, surplus_per_buffer: int) -> dict[int, int]:
        """The admission table with the extra groups the predicted tail does not call for withheld
        (``staleflow.strategies.over_reservation``). The tail: the longest predicted remainder of
        the unfinished members of the groups with the oldest V_traj (those the next buffer waits
        for), over a typical length. ``predicted``: every unfinished trajectory, with remainders."""
        versioned = [t for t in predicted if t.v_traj is not None]
        if not any(admission.values()) or not versioned:
            return dict(admission)
        oldest = min(t.v_traj for t in versioned if t.v_traj is not None)
        self.tail = predicted_tail((t.remaining for t in versioned if t.v_traj == oldest),
                                   self.predictor.typical_length())
        unused = surplus_per_buffer - extra_groups(self.tail, surplus_per_buffer, config.tail_threshold)
        spared = spare_admission(admission, eta, unused)
        self.withheld = sum(admission.values()) - sum(spared.values())
        return spared

    def forget_except(self, live_groups: Iterable[str]) -> None:
        """Drop the evidence of groups with nothing left to predict (their prompts' history stays)."""
        live = set(live_groups)
        for group_id in self._groups - live:
            self.predictor.forget_group(group_id)
        self._groups &= live

    def state(self) -> dict:
        m, tau2, s2 = self.predictor.prior()
        return {"epoch": self.epoch, "cursor": self.cursor, "observed": self.predictor.observed,
                "skipped": self.skipped, "typical_length": self.predictor.typical_length(),
                "tail": self.tail, "withheld": self.withheld,
                "log_mean": m, "group_variance": tau2, "member_variance": s2}


@dataclass(frozen=True)
class InstanceInputs:
    """What ``pull: auto`` read of one planned instance."""

    decode_steps: int | None  # the engine's counters at the snapshot (None: not reported)
    decode_seconds: float | None
    speed: float  # the decode speed they gave, against the cost model (1.0: as modelled, or no counters yet)
    kv_cache: float
    running: int


@dataclass(frozen=True)
class PullDecision:
    """One sync of a ``pull: auto`` cycle: whether its Pull kept the trajectories, and from what."""

    instance_id: str
    version: int
    kept: bool
    inputs: dict[str, InstanceInputs] = field(default_factory=dict)
