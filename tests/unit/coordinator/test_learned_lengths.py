"""The live coordinator's side of the finished-lengths feed (``LearnedLengths``): whatever pages a
server answers (re-reads from an older cursor, overlaps, pages of another epoch), each finished
length is learned exactly once, and the predictions then follow the learned lengths."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleflow.api.trajectories import FinishedLength, FinishedLengthsOut
from staleflow.coordinator.learning import LearnedLengths
from staleflow.length_prediction import LengthPredictor
from staleflow.strategies import PendingTrajectory


def _feed(lengths: list[int]) -> list[FinishedLength]:
    return [FinishedLength(id=k + 1, traj_id=f"g{k // 4}/{k % 4}", group_id=f"g{k // 4}", prompt_key=f"p{k // 8}",
                           length=n) for k, n in enumerate(lengths)]


def _page(feed: list[FinishedLength], after: int, limit: int, epoch: str = "e1") -> FinishedLengthsOut:
    rows = [f for f in feed if f.id > after][:limit]
    return FinishedLengthsOut(epoch=epoch, lengths=rows, next=rows[-1].id if rows else after, skipped=0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=40),
       reads=st.lists(st.tuples(st.integers(0, 45), st.integers(1, 10)), max_size=30))
def test_each_finished_length_is_learned_once_whatever_the_pages(lengths: list[int], reads: list[tuple[int, int]]) -> None:
    feed = _feed(lengths)
    learned = LearnedLengths()
    for after, limit in reads:  # stale or repeated reads: a page from any cursor, possibly overlapping
        learned.take(_page(feed, min(after, learned.cursor), limit))
    while learned.cursor < len(feed):  # then follow the cursor to the end
        learned.take(_page(feed, learned.cursor, 7))
    once = LengthPredictor()
    for f in feed:
        once.finished(f.group_id, f.length, f.prompt_key)
    assert learned.predictor.observed == len(feed) and learned.cursor == feed[-1].id
    assert learned.predictor.prior() == once.prior()
    assert learned.predictor.predict("g0", 0, (), "p0") == once.predict("g0", 0, (), "p0")


def test_a_page_of_another_epoch_is_dropped_and_the_feed_followed_from_its_start() -> None:
    learned = LearnedLengths()
    old, new = _feed([100, 100, 100]), _feed([900, 900])
    learned.take(_page(old, 0, 10))
    assert (learned.cursor, learned.predictor.observed) == (3, 3)
    assert learned.take(_page(new, learned.cursor, 10, epoch="e2")) == 0, "a cursor into another database"
    assert (learned.epoch, learned.cursor, learned.predictor.observed) == ("e2", 0, 3)
    learned.take(_page(new, learned.cursor, 10, epoch="e2"))
    assert (learned.cursor, learned.predictor.observed) == (2, 5)


def test_predictions_follow_the_learned_lengths_per_group_and_per_prompt() -> None:
    learned = LearnedLengths()
    prior = learned.predictor.typical_length()
    rows = [FinishedLength(id=k + 1, traj_id=f"{g}/{k}", group_id=g, prompt_key=p, length=n)
            for k, (g, p, n) in enumerate([("long", "pl", 3000), ("long", "pl", 3200), ("short", "ps", 40),
                                           ("short", "ps", 50), ("old-long", "pl", 2900)])]
    learned.take(FinishedLengthsOut(epoch="e", lengths=rows, next=5, skipped=0))
    assert learned.predictor.typical_length() != prior
    waiting = [PendingTrajectory("long/9", "long", 0, 10), PendingTrajectory("short/9", "short", 0, 10),
               PendingTrajectory("new/0", "new", None, 10), PendingTrajectory("again/0", "again", None, 10)]
    prompts = {"long": "pl", "short": "ps", "new": None, "again": "pl"}
    remaining = {t.traj_id: t.remaining for t in learned.with_remainders(waiting, {}, prompts)}
    assert remaining["long/9"] > 20 * remaining["short/9"] > 0, "the group's finished members"
    near = abs(remaining["again/0"] - remaining["long/9"])
    assert near < 0.2 * remaining["long/9"] < abs(remaining["new/0"] - remaining["long/9"]), \
        "a prompt sampled again brings its history; a new one has the prior"
    ran = learned.with_remainders(waiting[:1], {"long/9": 3500}, prompts)[0]
    assert 0 <= ran.remaining < remaining["long/9"], "tokens so far bound the length from below"
    learned.forget_except(["short"])
    forgotten = {t.traj_id: t.remaining for t in learned.with_remainders(waiting, {}, prompts)}
    assert forgotten["short/9"] == remaining["short/9"], "a live group keeps its evidence"
    assert forgotten["long/9"] == forgotten["again/0"], "a finished group's goes; its prompt's history stays"


def test_adaptive_redundancy_withholds_the_extra_groups_while_the_predicted_tail_is_short() -> None:
    from staleflow.config.strategy import StrategyConfig

    learned = LearnedLengths()
    rows = [FinishedLength(id=k + 1, traj_id=f"g{k}/0", group_id=f"g{k}", prompt_key=f"p{k}", length=100 + k)
            for k in range(20)]
    learned.take(FinishedLengthsOut(epoch="e", lengths=rows, next=20, skipped=0))
    config = StrategyConfig(adaptive_redundancy=True, tail_threshold=2.5)
    admission = {3: 4, 4: 6}  # trainer at version 4, eta 1: version 3 may still use buffer 4, version 4 buffers 4..5
    short = [PendingTrajectory("a/0", "a", 3, 10), PendingTrajectory("b/0", "b", 4, 10)]
    predicted = learned.with_remainders(short, {}, {})
    assert learned.spare_admission(admission, predicted, config, eta=1, surplus_per_buffer=2) == {3: 2, 4: 2}, \
        "a typical tail: both extra groups of every buffer withheld"
    assert learned.withheld == 6 and learned.tail is not None and learned.tail < 2.5
    long_members = [FinishedLength(id=21 + k, traj_id=f"a/{k + 1}", group_id="a", prompt_key="pa", length=2000)
                    for k in range(2)]
    learned.take(FinishedLengthsOut(epoch="e", lengths=long_members, next=22, skipped=0))
    long_running = learned.with_remainders(short, {}, {"a": "pa"})  # its group's members ran long: a long tail ahead
    assert learned.spare_admission(admission, long_running, config, eta=1, surplus_per_buffer=2) == admission
    assert learned.spare_admission({3: 0, 4: 0}, predicted, config, 1, 2) == {3: 0, 4: 0}
    assert learned.spare_admission(admission, [], config, 1, 2) == admission, "nothing started: no tail to predict"
