"""The real engine's time accounting: step classification, timeline, and a breakdown that sums."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from staleflow.engines.accounting import (
    RESUME_MARK,
    EngineTimeline,
    StepAccountant,
    StepTotals,
    VersionSwitches,
    breakdown,
)


@dataclass
class NewRequest:
    req_id: str
    num_computed_tokens: int = 0


@dataclass
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    """The fields of vLLM's SchedulerOutput the accountant reads."""

    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_mixed_step_is_split_by_its_tokens() -> None:
    clock = FakeClock()
    steps = StepAccountant(clock=clock, monotonic=clock)
    # a fresh prompt of 30 tokens, a resumed trajectory re-prefilling 10 (4 of them prefix-cached), 20 decoding
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequest("a#1-0f3c"), NewRequest(f"{RESUME_MARK}b#2-77aa", num_computed_tokens=4)],
        scheduled_cached_reqs=CachedRequests([f"c{i}" for i in range(20)], [3] * 20),
        num_scheduled_tokens={"a#1-0f3c": 30, f"{RESUME_MARK}b#2-77aa": 10, **{f"c{i}": 1 for i in range(20)}},
    )
    steps.begin(out)
    clock.now += 0.6
    steps.end()
    t = steps.totals
    assert t.tokens == {"prefill": 30, "reprefill": 10, "decode": 20}
    assert t.seconds["prefill"] == pytest.approx(0.3)
    assert t.seconds["reprefill"] == pytest.approx(0.1)
    assert t.seconds["decode"] == pytest.approx(0.2)
    assert t.steps == 1 and t.mixed_steps == 1 and t.step_seconds == pytest.approx(0.6)
    assert t.decode_steps == 0 and t.decode_step_seconds == 0, "a mixed step is no decode step"
    # then a step of the 21 running ones decoding only: one decode step, all its time
    steps.begin(SchedulerOutput(scheduled_cached_reqs=CachedRequests([f"c{i}" for i in range(20)] + ["a#1-0f3c"],
                                                                     [4] * 20 + [1]),
                                num_scheduled_tokens={**{f"c{i}": 1 for i in range(20)}, "a#1-0f3c": 1}))
    clock.now += 0.25
    steps.end()
    assert t.decode_steps == 1 and t.decode_step_seconds == pytest.approx(0.25)
    assert t.tokens["decode"] == 41 and t.steps == 2
    assert t.prefix_cached_tokens == {"prefill": 0, "reprefill": 4}
    assert t.first_step_started == 100.0


def test_chunked_prompts_keep_their_phase_and_preempted_requests_recompute() -> None:
    clock = FakeClock()
    steps = StepAccountant(clock=clock, monotonic=clock)
    resumed = f"{RESUME_MARK}r#5-aa"
    steps.begin(SchedulerOutput([NewRequest(resumed)], num_scheduled_tokens={resumed: 16}))
    clock.now += 1
    steps.end()
    # the rest of its prompt in the next step, plus one request vLLM preempted and now recomputes
    steps.begin(SchedulerOutput(
        scheduled_cached_reqs=CachedRequests([resumed, "p#1-bb"], [0, 7], resumed_req_ids={"p#1-bb"}),
        num_scheduled_tokens={resumed: 4, "p#1-bb": 19}))
    clock.now += 1
    steps.end()
    assert steps.totals.tokens == {"prefill": 0, "reprefill": 39, "decode": 0}
    assert steps.totals.preempted_recomputes == 1
    assert steps.totals.seconds["reprefill"] == pytest.approx(2.0)


def test_empty_steps_and_failed_steps_are_not_counted() -> None:
    clock = FakeClock()
    steps = StepAccountant(clock=clock, monotonic=clock)
    steps.begin(SchedulerOutput(finished_req_ids={"gone"}))
    clock.now += 5
    steps.end()
    steps.begin(SchedulerOutput([NewRequest("x#1-00")], num_scheduled_tokens={"x#1-00": 8}))
    clock.now += 5
    steps.abandon()
    steps.end()
    assert steps.totals.steps == 0 and steps.totals.step_seconds == 0
    assert steps.totals.first_step_started == 105.0  # the failed step did begin; the empty one did not


def test_timeline_counts_busy_pull_and_idle() -> None:
    clock = FakeClock()
    timeline = EngineTimeline(clock)
    clock.now += 2  # idle
    timeline.holding(True)
    clock.now += 3  # busy
    timeline.switch(EngineTimeline.PULL)
    timeline.holding(False)  # trajectories handed back by the Pull: still a Pull
    clock.now += 1.5
    timeline.switch(EngineTimeline.IDLE)
    clock.now += 0.5
    wall, states = timeline.totals()
    assert wall == pytest.approx(7.0)
    assert states == pytest.approx({"idle": 2.5, "busy": 3.0, "pull": 1.5})
    assert timeline.pulls == 1
    with pytest.raises(ValueError):
        timeline.switch("sleeping")


def test_breakdown_sums_to_the_rollout_time() -> None:
    steps = StepTotals(seconds={"prefill": 1.0, "reprefill": 0.5, "decode": 4.0})
    parts = breakdown(10.0, {"busy": 6.0, "pull": 1.0, "idle": 3.0}, steps)
    assert parts == pytest.approx({"prefill": 1.0, "reprefill": 0.5, "decode": 4.0, "overhead": 0.5,
                                   "pull": 1.0, "idle": 3.0})
    assert sum(parts.values()) == pytest.approx(10.0, abs=1e-12)


def test_breakdown_step_time_beyond_the_busy_intervals_comes_out_of_idle() -> None:
    # a step still finishing after its last trajectory was stopped ran in "idle" time
    parts = breakdown(10.0, {"busy": 5.0, "pull": 0.0, "idle": 5.0},
                      {"seconds": {"prefill": 0.0, "reprefill": 0.0, "decode": 5.2}})
    assert parts["overhead"] == 0.0 and parts["idle"] == pytest.approx(4.8)
    assert sum(parts.values()) == pytest.approx(10.0, abs=1e-12)
    assert all(v >= 0 for v in parts.values())


def test_version_switches_mark_where_the_new_weights_took_over_each_kept_request() -> None:
    """After a load that kept requests running, the scheduler's output-token count at each one's
    next step is where the new version starts; vLLM's id suffix is matched, a request that
    finished before running again gets no mark, one never scheduled before starts at 0."""
    switches = VersionSwitches()
    switches.expect(["a#1", "b#2", "c#3", "d#4"], version=5)
    switches.observe(SchedulerOutput(finished_req_ids={"c#3-9e0d"}))
    switches.observe(SchedulerOutput(
        scheduled_new_reqs=[NewRequest("d#4-1b2c")],
        scheduled_cached_reqs=CachedRequests(["a#1-0f3c", "x#9"], [17, 40]),
    ))
    switches.observe(SchedulerOutput(scheduled_cached_reqs=CachedRequests(["a#1-0f3c", "b#2"], [18, 3])))
    assert switches.marks(["a#1", "b#2", "c#3", "d#4"], forget=False) == {
        "a#1": [(17, 5)], "b#2": [(3, 5)], "d#4": [(0, 5)]}
    switches.expect(["a#1"], version=6)  # a second load: a second mark at its next step
    switches.observe(SchedulerOutput(scheduled_cached_reqs=CachedRequests(["a#1-0f3c"], [25])))
    assert switches.marks(["a#1"], forget=True) == {"a#1": [(17, 5), (25, 6)]}
    assert switches.marks(["a#1"], forget=False) == {}
