"""Staleness is measured from the oldest model version that generated any trained token, not from
V_traj alone, wherever it is reported: the trainer's step records (and so summary.json) and the
trajectory server's length-skew accounting (and so its /v1/health and Prometheus)."""

from __future__ import annotations

from types import SimpleNamespace

from staleflow.length_skew import LengthSkew
from staleflow.report import summarize
from staleflow.training.role import batch_record
from staleflow.trajectory_book import Generated, SegmentLimits, TrajectoryBook

ETA = 2


def _trajectory(v_traj: int, segments: list[tuple[int, int, int]]) -> dict:
    n = segments[-1][2] if segments else 0
    return {"v_traj": v_traj, "tokens": [1] * n, "reward": 1.0,
            "segments": [{"version": v, "start": s, "end": e} for v, s, e in segments]}


def test_a_step_record_measures_staleness_from_the_oldest_segment() -> None:
    batch = {"groups": ["g"], "trajectories": [
        _trajectory(1, [(2, 0, 4)]),  # all of it newer than V_traj: staleness 3 - 2
        _trajectory(1, [(1, 0, 2), (3, 2, 4)]),  # partly V_traj's model: 3 - 1
        _trajectory(1, []),  # nothing generated: from V_traj
    ]}
    assert batch_record(3, batch, 0.0, {}).staleness == {1: 1, 2: 2}


def test_a_token_older_than_the_bound_counts_as_a_violation_in_the_summary() -> None:
    """A batch whose V_traj keeps the bound but one token of which comes from a model five
    versions older (what an unchecked completion could once carry into a batch)."""
    batch = {"groups": ["g"], "trajectories": [_trajectory(4, [(4, 0, 2)]), _trajectory(4, [(1, 0, 2), (4, 2, 4)])]}
    step = batch_record(6, batch, 1.0, {})
    config = SimpleNamespace(ledger=SimpleNamespace(eta=ETA, batch_size=1, group_size=2), engine="sim", speed=1.0,
                             instances=1, routing="r", sync="s", migration="m")
    summary = summarize(config, [step], [], {}, {}, 1.0, "simulated")
    assert summary["staleness_per_buffer"] == {"6": {"2": 1, "5": 1}}
    assert summary["staleness_violations"] == 1


def test_the_trajectory_servers_accounting_measures_from_the_oldest_segment() -> None:
    book = TrajectoryBook()
    groups, trajs = book.new_groups([(0, "q", "a", (1, 2))], 1, 1, 0.0)
    book.add(groups, trajs)
    book.set_group_version("g0", 1)
    book.checkout("i0", ["g0-m0"])
    book.completed([Generated("g0-m0", (5, 6), (-1.0, -1.0), ((2, 0, 2),), "stop", "i0")],
                   SegmentLimits(newest_version=2, max_tokens=8))
    book.rewarded({"g0-m0": (1.0, "correct")})
    book.mark_consumed(["g0"], buffer=3)
    staleness = book.skew.totals().staleness
    assert {k: n for hist in staleness.values() for k, n in hist.items()} == {1: 1}, "3 - 2, not 3 - V_traj 1"


def test_violations_are_trained_trajectories_outside_the_bound() -> None:
    skew = LengthSkew()
    for traj_id, length in (("a", 4), ("b", 40), ("c", 400)):
        skew.generated(traj_id, length)
    skew.consumed(5, [("a", 0), ("b", ETA), ("c", ETA + 3)])
    assert skew.totals().violations(ETA) == 1
