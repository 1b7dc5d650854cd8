"""The length-skew accounting: a hand-computed case, and its invariants over random event lists."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.length_skew import (
    LengthSkew,
    StepSkew,
    TrajectoryFate,
    bucket_bounds,
    bucket_label,
    bucket_of,
    ks_distance,
    wasserstein_distance,
)


def test_buckets_are_powers_of_two_for_any_length():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 1023, 1024, 32768)] == [0, 1, 2, 2, 3, 3, 4, 10, 11, 16]
    assert [bucket_label(k) for k in range(5)] == ["0", "1", "2-3", "4-7", "8-15"]
    for n in (0, 1, 5, 255, 256, 10**9):
        low, high = bucket_bounds(bucket_of(n))
        assert low <= n <= high
    with pytest.raises(ValueError, match=">= 0"):
        bucket_of(-1)


def hand_computed_run() -> LengthSkew:
    skew = LengthSkew()
    # step 0's window: two groups sampled at t=0; g1 admitted at once, g2 after 3 s
    skew.sampled(["g1", "g2"], 0.0)
    skew.admitted("g1", 0.0)
    skew.admitted("g2", 3.0)
    skew.generated("a", 3)  # bucket 2 (2-3)
    skew.generated("b", 5)  # bucket 3 (4-7)
    skew.generated("c", 100)  # bucket 7 (64-127)
    skew.generated("c", 100)  # a redelivery: counted once
    skew.stopped("d", 40, TrajectoryFate.ABORTED)  # cut while running at 40 tokens: bucket 6 (32-63)
    skew.stopped("e", 0, TrajectoryFate.ABORTED)  # never generated anything: not counted
    skew.settle("c", TrajectoryFate.DROPPED)  # a surplus member
    skew.regenerated(length=90, tokens=30)  # a trajectory at 90 tokens lost 30 to a failure
    skew.consumed(0, [("a", 0), ("b", 1)])
    # step 1's window
    skew.sampled(["g3"], 10.0)
    skew.admitted("g3", 14.0)
    skew.generated("f", 6)
    skew.generated("g", 6)
    skew.settle("f", TrajectoryFate.FILTERED)
    skew.settle("unknown", TrajectoryFate.FILTERED)  # generated before a restart: nothing to count
    skew.consumed(1, [("g", 2)])
    skew.generated("h", 1)  # in flight at the end
    return skew


def test_a_hand_computed_run():
    skew = hand_computed_run()
    step0, step1 = (skew.steps[0].to_json(), skew.steps[1].to_json())
    assert step0["generated"] == {"2-3": 1, "4-7": 1, "64-127": 1, "32-63": 1}
    assert step0["trained"] == {"2-3": 1, "4-7": 1}
    assert step0["aborted"] == {"32-63": 1}
    assert step0["dropped"] == {"64-127": 1}
    assert step0["filtered"] == {}
    assert step0["staleness_mean"] == {"2-3": 0.0, "4-7": 1.0}
    assert step0["regenerated"] == {"64-127": 1} and step0["regenerated_tokens"] == {"64-127": 30}
    assert step0["generated_mean"] == pytest.approx((3 + 5 + 100 + 40) / 4)
    assert step0["trained_mean"] == 4.0
    assert step0["admission"] == {"admitted": 2, "waited": 1, "mean_wait_s": 3.0, "max_wait_s": 3.0}
    assert step1["generated"] == {"4-7": 2} and step1["trained"] == {"4-7": 1} and step1["filtered"] == {"4-7": 1}
    assert step1["staleness_mean"] == {"4-7": 2.0}
    assert step1["admission"] == {"admitted": 1, "waited": 1, "mean_wait_s": 4.0, "max_wait_s": 4.0}

    run = skew.to_json()
    assert run["generated"] == {"1": 1, "2-3": 1, "4-7": 3, "32-63": 1, "64-127": 1}
    assert run["trained"] == {"2-3": 1, "4-7": 2} and run["dropped"] == {"64-127": 1}
    assert run["in_flight"] == {"1": 1}
    assert run["staleness_mean"] == {"2-3": 0.0, "4-7": 1.5}
    assert run["admission"]["waited"] == 2 and run["admission"]["mean_wait_s"] == 3.5
    # trained lengths {3, 5, 6} against those generated whose fate is known {3, 5, 100, 40, 6, 6}
    # ("h" is still in flight)
    assert run["trained_over_generated_mean"] == pytest.approx((14 / 3) / (160 / 6))
    assert run["ks_distance"] == pytest.approx(1 / 3)  # at 5: 2/3 trained against 2/6 generated
    # the area between the CDFs: [3,5) 1/6, [5,6) 1/3, [6,40) 1/3, [40,100) 1/6
    assert run["wasserstein_tokens"] == pytest.approx(2 / 6 + 1 / 3 + 34 / 3 + 60 / 6)


def test_distances_against_hand_computed_values():
    same = Counter({1: 2, 4: 1})
    assert ks_distance(same, same) == 0.0 and wasserstein_distance(same, same) == 0.0
    # all mass at 2 against all at 10: KS 1, W1 = 8 tokens
    assert ks_distance(Counter({2: 5}), Counter({10: 1})) == 1.0
    assert wasserstein_distance(Counter({2: 5}), Counter({10: 1})) == 8.0
    # {1, 3} against {3}: CDFs differ by 1/2 over [1, 3): W1 = 1
    assert wasserstein_distance(Counter({1: 1, 3: 1}), Counter({3: 1})) == 1.0
    assert ks_distance(Counter(), same) is None and wasserstein_distance(same, Counter()) is None


EVENT = st.one_of(
    st.tuples(st.just("generated"), st.integers(0, 30), st.integers(0, 5000)),
    st.tuples(st.just("settle"), st.integers(0, 30), st.sampled_from([f for f in TrajectoryFate if f is not TrajectoryFate.TRAINED])),
    st.tuples(st.just("stopped"), st.integers(0, 30), st.integers(0, 5000),
              st.sampled_from([TrajectoryFate.ABORTED, TrajectoryFate.DROPPED, TrajectoryFate.FILTERED])),
    st.tuples(st.just("consumed"), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 4)), max_size=6)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(EVENT, max_size=80))
def test_every_generated_trajectory_has_one_fate_or_is_in_flight(events):
    skew = LengthSkew()
    buffer = 0
    for event in events:
        if event[0] == "generated":
            skew.generated(f"t{event[1]}", event[2])
        elif event[0] == "settle":
            skew.settle(f"t{event[1]}", event[2])
        elif event[0] == "stopped":
            skew.stopped(f"t{event[1]}", event[2], event[3])
        else:
            skew.consumed(buffer, [(f"t{i}", s) for i, s in event[1]])
            buffer += 1
    total = skew.totals()
    in_flight = skew.in_flight()
    for bucket in set(total.generated) | set(in_flight):
        fated = sum(total.fates[f][bucket] for f in TrajectoryFate)
        assert total.generated[bucket] == fated + in_flight[bucket]
    assert sum(skew.generated_lengths.values()) == sum(total.generated.values())
    assert sum(skew.trained_lengths.values()) == sum(total.fates[TrajectoryFate.TRAINED].values())
    assert sum(sum(h.values()) for h in total.staleness.values()) == sum(total.fates[TrajectoryFate.TRAINED].values())
    ks = skew.to_json()["ks_distance"]
    assert ks is None or 0.0 <= ks <= 1.0


def _simulated(name: str, eta: int = 1, steps: int = 6):
    from staleflow.simulation import ClusterSimulation, scenario
    from staleflow.simulation.experiment import Point, SimulatedJob
    from staleflow.simulation.systems import catalog

    ci = scenario("ci", seed=0)
    system = {s.name: s for s in catalog(ci.redundancy)}[name]
    simulation = ClusterSimulation(SimulatedJob(Point(0, eta, ci), system, 2, steps).config())
    return simulation, simulation.run(steps)


@pytest.mark.parametrize("name", ["in-flight", "in-flight-fifo", "sf-rsm", "sf-rsm+batch", "sf-rsm+group"])
def test_the_simulation_accounts_for_every_trajectory_it_generated(name):
    simulation, result = _simulated(name)
    skew = simulation.skew
    total, in_flight = skew.totals(), skew.in_flight()
    for bucket in set(total.generated) | set(in_flight):
        assert total.generated[bucket] == sum(total.fates[f][bucket] for f in TrajectoryFate) + in_flight[bucket]
    trained = sum(r.trajectories for r in result.step_records)
    assert sum(total.fates[TrajectoryFate.TRAINED].values()) == trained
    assert sum(n * k for k, n in skew.trained_lengths.items()) == result.response_tokens
    for record in result.step_records:  # each step trains what its batch held, with the batch's staleness
        window = skew.steps[record.buffer]
        assert sum(window.fates[TrajectoryFate.TRAINED].values()) == record.trajectories
        staleness = Counter()
        for hist in window.staleness.values():
            staleness.update(hist)
        assert dict(staleness) == record.staleness
    assert total.admission.admitted >= trained // 4  # every trained group was admitted once
    assert result.length_skew["ks_distance"] is not None


def test_redundancy_drops_and_the_simulation_reports_it():
    for name in ("sf-rsm+batch", "sf-rsm+group"):
        _, result = _simulated(name)
        assert result.length_skew["dropped"], f"{name} drops surplus trajectories"
        assert not result.length_skew["filtered"], "the simulation filters nothing"


def test_the_trajectory_books_transitions_feed_it():
    from staleflow.trajectory_book import ABORTED_ON_INSTANCE, Generated, GroupState, TrajectoryBook

    book = TrajectoryBook()
    groups, trajs = book.new_groups([(0, "q", "a", (1,)), (1, "q", "a", (1,))], 3, 2, 10.0)  # 3 members, 2 needed
    book.add(groups, trajs)
    book.set_group_version("g0", 1, now=12.5)
    book.set_group_version("g1", 1, now=10.0)
    book.checkout("i0", ["g0-m0", "g0-m1", "g0-m2", "g1-m0", "g1-m1"])

    def done(traj_id: str, n: int, reason: str = "stop") -> Generated:
        return Generated(traj_id, tuple(range(n)), tuple(-1.0 for _ in range(n)), ((1, 0, n),), reason, "i0")

    book.completed([done("g0-m0", 5), done("g0-m1", 20), done("g1-m0", 4), done("g1-m1", 6)])
    book.holding("i0", {"g0-m2": 9})
    book.rewarded({t: (1.0, "correct") for t in ("g0-m0", "g0-m1", "g1-m0", "g1-m1")})
    book.close_group("g0", GroupState.OCCUPIED)  # g0-m2 is cut on its instance: dropped
    book.completed([done("g0-m2", 11, ABORTED_ON_INSTANCE)])  # it had reached 11 tokens
    book.close_group("g1", GroupState.ABORTED, TrajectoryFate.FILTERED)  # g1-m2 never ran: not counted
    book.mark_consumed(["g0"], buffer=2)
    book.free(["g0"], buffer=2)  # the same batch again: counted once

    run = book.skew.to_json()
    assert run["generated"] == {"4-7": 3, "8-15": 1, "16-31": 1}
    assert run["trained"] == {"4-7": 1, "16-31": 1} and run["staleness_mean"] == {"4-7": 1.0, "16-31": 1.0}
    assert run["dropped"] == {"8-15": 1} and run["filtered"] == {"4-7": 2} and run["aborted"] == {}
    assert run["in_flight"] == {}
    assert run["admission"] == {"admitted": 2, "waited": 1, "mean_wait_s": 2.5, "max_wait_s": 2.5}
    assert [s["step"] for s in run["per_step"]] == [2]
    assert book.skew.step == 3


def test_the_report_and_tracking_show_it(tmp_path):
    from staleflow.report import length_skew_markdown, plot_length_skew
    from staleflow.tracking import step_metrics

    run = hand_computed_run().to_json()
    table = length_skew_markdown(run)
    # bucket, generated, trained, aborted, filtered, dropped, in flight, regenerated (tokens), mean staleness
    assert "| 4-7 | 3 | 2 | 0 | 1 | 0 | 0 | 0 (0) | 1.50 |" in table
    assert "| 64-127 | 1 | 0 | 0 | 0 | 1 | 0 | 1 (30) | - |" in table
    assert "| 1 | 1 | 0 | 0 | 0 | 0 | 1 | 0 (0) | - |" in table
    # step, generated (mean), trained (mean), cut, regenerated tokens, admission
    assert "| 0 | 4 (37.0) | 2 (4.0) | 1/0/1 | 30 | 2 (1, 3.00) |" in table
    assert plot_length_skew(tmp_path / "skew.png", run).stat().st_size > 1000

    step = {"version": 0, "mean_reward": 0.5, "mean_length": 4.0, "max_length": 5, "response_tokens": 8,
            "trajectories": 2, "staleness": {0: 1, 1: 1}, "finished_at": 1.0}
    scalars, histograms = step_metrics(step, None, length_skew=run["per_step"][0])
    assert scalars["length_skew/generated"] == 4 and scalars["length_skew/trained"] == 2
    assert scalars["length_skew/aborted"] == 1 and scalars["length_skew/dropped"] == 1
    assert scalars["length_skew/trained_over_generated_mean"] == pytest.approx(4.0 / 37.0)
    assert scalars["length_skew/regenerated_tokens"] == 30 and scalars["length_skew/admission_waited"] == 1
    assert scalars["length_skew/staleness_mean/4-7"] == 1.0
    assert histograms["length_skew/trained"] == {2: 1, 3: 1}  # bucket indexes: 2-3 and 4-7


def _feed(skew: LengthSkew, steps: list[list[tuple[str, int, float]]]) -> None:
    """Each step: trajectories (id, length, admission wait) sampled, generated and trained, a
    third of them cut instead, one regenerated; then the step's buffer is consumed."""
    for step, trajs in enumerate(steps):
        trained = []
        for i, (name, length, wait) in enumerate(trajs):
            traj_id = f"{step}-{i}-{name}"
            skew.sampled([traj_id], 0.0)
            skew.admitted(traj_id, wait)
            if i % 3 == 2:
                skew.stopped(traj_id, length, TrajectoryFate.ABORTED)
                continue
            skew.generated(traj_id, length)
            trained.append((traj_id, i % 2))
        skew.regenerated(length=len(trajs) + 1, tokens=step)
        skew.consumed(step, trained)


@given(st.lists(st.lists(st.tuples(st.text("ab", max_size=2), st.integers(0, 300), st.sampled_from([0.0, 0.5, 2.0])),
                         max_size=6), max_size=25),
       st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_only_the_newest_windows_stay_and_the_totals_keep_every_step(steps, kept):
    bounded, every = LengthSkew(windows_kept=kept), LengthSkew(windows_kept=10**6)
    _feed(bounded, steps)
    _feed(every, steps)
    assert sorted(bounded.steps) == sorted(every.steps)[-kept:]
    for step in bounded.steps:
        assert bounded.steps[step].to_json() == every.steps[step].to_json()
    added = StepSkew(-1)  # the totals are every window added up, the ones let go included
    for window in every.steps.values():
        added.add(window)
    assert bounded.totals().to_json() == every.totals().to_json() == added.to_json()
    assert bounded.to_json() == {**every.to_json(), "per_step": every.to_json()["per_step"][-kept:]}


def test_reading_the_totals_touches_no_window():
    """Health and every metrics scrape read the totals: they cost the same at step 10 and at step 100,000."""
    skew = LengthSkew(windows_kept=3)
    _feed(skew, [[("x", 5, 1.0)] * 3] * 10)
    skew.steps.clear()
    assert skew.totals().fates[TrajectoryFate.TRAINED].total() == 20 and skew.totals().admission.admitted == 30
    with pytest.raises(ValueError, match="windows_kept"):
        LengthSkew(windows_kept=0)
