"""The simulator's weight-transfer model: a fan-out from the parameter server shares its egress;
peers with pipeline replication finish a burst in about one pull plus a hop per level."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.simulation.transfer import TransferSchedule, WeightSource, WeightTransfer

GB = 1e9
LINK = 25 * GB
SIZE = 61 * GB  # Qwen3-30B-A3B in bf16
ONE_PULL = SIZE / LINK


def burst(transfer: WeightTransfer, instances: int, start: float = 0.0, version: int = 1) -> list[float]:
    schedule = TransferSchedule(transfer)
    return [schedule.pull(f"inst-{i}", version, start, SIZE, LINK) for i in range(instances)]


def test_an_unlimited_ps_serves_every_pull_as_if_alone() -> None:
    transfer = WeightTransfer()
    assert not transfer.contends
    assert burst(transfer, 64) == [ONE_PULL] * 64


def test_a_fan_out_of_n_from_one_endpoint_takes_n_pulls() -> None:
    durations = burst(WeightTransfer(ps_egress_bytes_per_s=LINK), 8)
    assert durations == pytest.approx([ONE_PULL * k for k in range(1, 9)])
    assert max(durations) == pytest.approx(8 * ONE_PULL)


def test_an_egress_of_four_links_serves_four_at_link_speed_then_queues() -> None:
    durations = burst(WeightTransfer(ps_egress_bytes_per_s=4 * LINK), 8)
    assert durations[:4] == pytest.approx([ONE_PULL] * 4)
    assert durations[4:] == pytest.approx([ONE_PULL * k / 4 for k in range(5, 9)])


def test_peers_finish_a_burst_in_about_one_pull_plus_a_hop_per_instance() -> None:
    transfer = WeightTransfer(WeightSource.ROS, ps_egress_bytes_per_s=LINK)
    durations = burst(transfer, 128)
    hop = transfer.hop_seconds(LINK, LINK)
    assert durations[0] == pytest.approx(ONE_PULL)
    assert max(durations) == pytest.approx(ONE_PULL + 127 * hop)
    assert max(durations) <= 1.5 * ONE_PULL  # against 128 x for the fan-out


def test_a_slow_peer_bounds_its_own_pull_and_the_chain_goes_around_it() -> None:
    transfer = WeightTransfer(WeightSource.ROS, ps_egress_bytes_per_s=LINK)
    schedule = TransferSchedule(transfer)
    first = schedule.pull("fast-0", 1, 0.0, SIZE, LINK)
    slow = schedule.pull("slow", 1, 0.0, SIZE, LINK / 4)
    after = schedule.pull("fast-1", 1, 0.0, SIZE, LINK)
    assert slow >= SIZE / (LINK / 4)
    assert after == pytest.approx(first + transfer.hop_seconds(LINK, LINK))  # follows the fast holder, not the slow one


def test_an_instance_that_moved_on_serves_the_old_version_no_more() -> None:
    transfer = WeightTransfer(WeightSource.ROS, ps_egress_bytes_per_s=LINK)
    schedule = TransferSchedule(transfer)
    schedule.pull("a", 1, 0.0, SIZE, LINK)
    schedule.pull("a", 2, 100.0, SIZE, LINK)  # a reuses its buffers for version 2
    # b asks for version 1 later: only the PS has it now, and its egress is free again
    assert schedule.pull("b", 1, 200.0, SIZE, LINK) == pytest.approx(ONE_PULL)


def test_pulls_of_a_new_version_queue_behind_the_old_ones_on_the_one_ps_egress() -> None:
    schedule = TransferSchedule(WeightTransfer(ps_egress_bytes_per_s=LINK))
    schedule.pull("a", 1, 0.0, SIZE, LINK)
    assert schedule.pull("b", 2, 0.0, SIZE, LINK) == pytest.approx(2 * ONE_PULL)


@pytest.mark.parametrize("kwargs", [{"ps_egress_bytes_per_s": 0}, {"chunk_bytes": 0}, {"hop_rtt_s": -1}])
def test_a_transfer_model_refuses_impossible_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WeightTransfer(**kwargs)


pulls = st.lists(st.tuples(st.integers(0, 5), st.floats(0, 5.0), st.floats(0.1, 4.0), st.integers(1, 3)),
                 min_size=1, max_size=40)


@given(pulls, st.floats(0.5, 8.0))
def test_peers_never_make_a_pull_slower_than_the_fan_out_and_nothing_beats_a_link(events: list, egress: float) -> None:
    """The same pulls (instance, start gap, link, version), in order: every pull under ros takes
    at most what it takes under ps (the PS stays a candidate, with less queued on it), and no
    pull beats its own link; under ps the egress never delivers more than its rate."""
    schedules = {source: TransferSchedule(WeightTransfer(source, ps_egress_bytes_per_s=egress, chunk_bytes=1))
                 for source in WeightSource}
    now, spans = 0.0, []
    for instance, gap, link, version in events:
        now += gap
        took = {source: schedule.pull(f"i{instance}", version, now, 1.0, link) for source, schedule in schedules.items()}
        assert took[WeightSource.ROS] <= took[WeightSource.PS] + 1e-9
        assert min(took.values()) >= 1.0 / link - 1e-9
        spans.append((now, now + took[WeightSource.PS]))
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    assert len(spans) <= egress * (last - first) + 1e-6
    assert all(math.isfinite(e) for _, e in spans)


def test_in_a_job_a_slow_ps_egress_lengthens_pulls_and_peer_serving_wins_it_back() -> None:
    from dataclasses import replace

    from staleflow.simulation import resolve, scenario
    from staleflow.simulation.experiment import Point, SimulatedJob, run_job

    ci = scenario("ci")
    staleflow, peered = resolve("staleflow,staleflow+ros")
    assert peered.name == "sf-rsm+ros" and peered.weight_source is WeightSource.ROS

    def pull_seconds(transfer: WeightTransfer, system=staleflow) -> tuple[float, int]:
        run = run_job(SimulatedJob(Point(0, 2, replace(ci, transfer=transfer)), system, 3, 4))
        assert run.violations == 0
        return run.breakdown.pull_s, run.counters["pulls"]

    alone, pulls = pull_seconds(WeightTransfer())
    assert pulls > 3
    slow = WeightTransfer(ps_egress_bytes_per_s=ci.sim.model_bytes / 0.5)  # a pull alone: 0.5 s of the PS's egress
    fan_out, _ = pull_seconds(slow)
    peers, _ = pull_seconds(slow, peered)
    assert fan_out > alone and peers < fan_out
