"""Named scenarios of the staleness ledger."""

from __future__ import annotations

import pytest

from staleflow.config.manager import LedgerParams
from staleflow.ledger import BufferState, EntryStatus, GroupFate, Ledger, LedgerError


def states(ledger: Ledger) -> dict[int, str]:
    return {b.version: b.state.value for b in ledger.buffers()}


def contents(ledger: Ledger, version: int) -> dict[str, str]:
    view = next(b for b in ledger.buffers() if b.version == version)
    return {e.group_id: e.status.value for e in view.entries}


def test_figure7_walkthrough_eta1() -> None:
    """Paper §4.2, Figure 7 (left), eta = 1, instances running up to three trajectories each.

    The markdown copy of the paper has the figure's text, not its drawing, so the sequence is
    reconstructed from that text: worst-case Reserve, greedy Occupy, Waiting/Stuck/Ready states,
    a Stuck buffer blocking stale versions while a newer version is still admitted, and partial
    rollout leaving the entry untouched.
    """
    ledger = Ledger(LedgerParams(eta=1, batch_size=3))
    assert states(ledger) == {0: "waiting", 1: "waiting"}
    assert ledger.admission() == {0: 6}

    # T1: instance 1 (version 0) starts trajectories 1-3: worst-case Reserve fills buffer 1 first
    assert [ledger.reserve(g, 0).buffer for g in ("t1", "t2", "t3")] == [1, 1, 1]
    assert states(ledger) == {0: "waiting", 1: "stuck"}
    # buffer 0 still Waiting, so instance 2 (also version 0) may start trajectories 4-6
    assert [ledger.reserve(g, 0).buffer for g in ("t4", "t5", "t6")] == [0, 0, 0]
    assert states(ledger) == {0: "stuck", 1: "stuck"}
    assert ledger.admission() == {0: 0}
    with pytest.raises(LedgerError) as refused:
        ledger.reserve("t7", 0)
    assert refused.value.code == "not_admissible"

    # T1': trajectories 1 and 4 complete: Occupy moves them to the earliest buffer and pushes
    # reservations later (entry deletion and movement, Figure 7 right)
    assert ledger.occupy("t1").buffer == 0
    assert ledger.occupy("t4").buffer == 0
    assert contents(ledger, 0) == {"t1": "occupied", "t4": "occupied", "t6": "reserved"}
    assert set(contents(ledger, 1).values()) == {"reserved"}

    # T2: trajectories 5 and 2 complete: buffer 0 holds three occupied entries and is Ready
    ledger.occupy("t5")
    assert ledger.occupy("t2").buffer == 1  # buffer 0 is full, the next earliest slot is in 1
    assert states(ledger) == {0: "ready", 1: "stuck"}
    with pytest.raises(LedgerError):
        ledger.reserve("t7", 0)  # nothing is gained by waiting: version 0 has no room left

    consumed = ledger.consume()
    assert consumed.buffer == 0 and consumed.consumed == ["t1", "t4", "t5"]
    assert ledger.train_version == 1

    # T2': buffer 1 is Stuck (t3, t6 still running), blocking V_traj = 0; buffer 2 is Waiting,
    # so a trajectory may be assigned V_traj = 1 once instance 2 has pulled version 1
    assert states(ledger) == {1: "stuck", 2: "waiting"}
    assert ledger.admission() == {0: 0, 1: 3}
    # partial rollout: t3 is interrupted and resumed on instance 2 at version 1. That is
    # transparent to the protocol: there is no ledger call, and t3 keeps its entry and version.
    before = contents(ledger, 1)
    assert ledger.reserve("t7", 1).buffer == 2
    assert contents(ledger, 1) == before
    assert ledger.entry("t3").v_traj == 0

    # t3 and t6 finish (t6 after re-prefill elsewhere): buffer 1 becomes Ready and trains
    # version 1 -> 2 with data at most eta = 1 version stale
    ledger.occupy("t3")
    ledger.occupy("t6")
    assert states(ledger)[1] == "ready"
    batch = ledger.consume()
    assert sorted(batch.consumed) == ["t2", "t3", "t6"]
    assert all(ledger.fate(g) is GroupFate.CONSUMED for g in batch.consumed)
    assert contents(ledger, 2) == {"t7": "reserved"}


def test_eta_zero_is_synchronous() -> None:
    ledger = Ledger(LedgerParams(eta=0, batch_size=2))
    assert ledger.admission() == {0: 2}
    ledger.reserve("a", 0)
    ledger.reserve("b", 0)
    assert ledger.admission() == {0: 0}
    ledger.occupy("a")
    with pytest.raises(LedgerError) as not_ready:
        ledger.consume()
    assert not_ready.value.code == "not_ready" and not_ready.value.details["state"] == "stuck"
    ledger.occupy("b")
    assert ledger.consume().consumed == ["a", "b"]
    assert ledger.admission() == {1: 2}  # only the new version: version 0 data cannot train version 1


def test_abort_moves_later_occupants_forward() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2))
    for g in "abcd":
        ledger.reserve(g, 0)
    for g in "abc":
        ledger.occupy(g)
    assert states(ledger) == {0: "ready", 1: "stuck"}
    ledger.abort("a")  # filtered (e.g. zero reward variance): c moves forward, buffer 0 stays Ready
    assert contents(ledger, 0) == {"b": "occupied", "c": "occupied"}
    assert states(ledger)[0] == "ready"
    assert ledger.fate("a") is GroupFate.ABORTED


def test_refusals_are_clear_and_leave_state_untouched() -> None:
    ledger = Ledger(LedgerParams(eta=2, batch_size=2))
    ledger.reserve("g", 0)
    before = (ledger.buffers(), ledger.admission())
    cases = [
        (lambda: ledger.reserve("g", 0), "duplicate_group"),
        (lambda: ledger.reserve("h", -1), "invalid_version"),
        (lambda: ledger.reserve("h", 1), "invalid_version"),  # the trainer has not produced version 1
        (lambda: ledger.reserve("", 0), "invalid_group"),
        (lambda: ledger.occupy("nope"), "unknown_group"),
        (lambda: ledger.abort("nope"), "unknown_group"),
        (lambda: ledger.consume(), "not_ready"),
    ]
    for call, code in cases:
        with pytest.raises(LedgerError) as err:
            call()
        assert err.value.code == code and err.value.message
        assert (ledger.buffers(), ledger.admission()) == before
    ledger.occupy("g")
    with pytest.raises(LedgerError) as twice:
        ledger.occupy("g")
    assert twice.value.code == "invalid_status"
    ledger.abort("g")
    with pytest.raises(LedgerError) as reused:
        ledger.reserve("g", 0)
    assert reused.value.code == "duplicate_group" and "single-use" in reused.value.message


def test_too_stale_version_is_refused_with_reason() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=1))
    for step in range(3):
        ledger.reserve(f"s{step}", step)
        ledger.occupy(f"s{step}")
        ledger.consume()
    assert ledger.train_version == 3
    assert ledger.admission([0, 1, 2, 3]) == {0: 0, 1: 0, 2: 1, 3: 2}  # v=2 fits only buffer 3
    with pytest.raises(LedgerError) as err:
        ledger.reserve("old", 1)
    assert "too stale" in err.value.message


def test_batch_redundancy_seals_and_cancels_surplus() -> None:
    # Appendix C: 1/2 redundancy admits 3 groups per buffer of 2; the slowest is aborted
    ledger = Ledger(LedgerParams(eta=0, batch_size=2, batch_redundancy=0.5))
    assert ledger.capacity == 3 and ledger.admission() == {0: 3}
    for g in "abc":
        ledger.reserve(g, 0)
    assert ledger.occupy("b").cancelled == []
    sealed = ledger.occupy("c")
    assert sealed.cancelled == ["a"], "the still-running group is surplus once the buffer is Ready"
    assert ledger.fate("a") is GroupFate.SURPLUS
    assert ledger.buffers()[0].state is BufferState.READY
    assert ledger.admission() == {0: 0}, "a sealed buffer admits nothing more"
    assert ledger.consume().consumed == ["b", "c"]


def test_redundancy_unseals_when_a_sealed_group_is_filtered() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2, batch_redundancy=0.5))
    for g in "abcde":
        ledger.reserve(g, 0)
    ledger.occupy("a")
    ledger.occupy("b")
    assert ledger.sealed == ("a", "b")
    ledger.abort("a")  # filtered after sealing
    assert ledger.sealed == ()
    assert ledger.buffers()[0].state is not BufferState.READY
    ledger.occupy("c")
    assert ledger.sealed == ("b", "c")
    assert ledger.consume().consumed == ["b", "c"]


def test_group_level_redundancy_completes_at_group_size() -> None:
    # 2 of 3 members are enough; the third is reported so it can be cancelled
    ledger = Ledger(LedgerParams(eta=1, batch_size=1, group_size=2, group_redundancy=0.5))
    assert ledger.params.group_members == 3
    ledger.reserve("g", 0)
    first = ledger.complete_member("g", "m0")
    assert first.op == "complete_member" and ledger.entry("g").status is EntryStatus.RESERVED
    assert ledger.complete_member("g", "m0").completed_members == ["m0"], "idempotent on retry"
    done = ledger.complete_member("g", "m2")
    assert done.op == "occupy" and done.completed_members == ["m0", "m2"]
    assert ledger.entry("g").status is EntryStatus.OCCUPIED
    with pytest.raises(LedgerError) as late:
        ledger.complete_member("g", "m1")
    assert late.value.code == "group_complete"


def test_restore_round_trip() -> None:
    params = LedgerParams(eta=2, batch_size=2)
    ledger = Ledger(params)
    for i in range(6):
        ledger.reserve(f"g{i}", 0)
    for i in (0, 3, 4):
        ledger.occupy(f"g{i}")
    ledger.abort("g5")
    restored = Ledger.restore(params, ledger.train_version, ledger.entries(),
                              {"g5": GroupFate.ABORTED}, ledger.sealed)
    assert restored.buffers() == ledger.buffers()
    assert restored.admission() == ledger.admission()
    assert restored.consume().consumed == ledger.consume().consumed


def test_what_if_answers_admissible_with_the_room_left() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2))
    ledger.reserve("a", 0)
    answer = ledger.what_if(0, 3)
    assert answer.admissible and answer.room == 3 and answer.consume_through is None and answer.then_version is None
    assert "3 groups with v_traj 0 fit now" in answer.reason


def test_what_if_names_the_full_buffers_and_the_buffer_to_consume_first() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2))
    for g in "abcd":
        ledger.reserve(g, 0)
    answer = ledger.what_if(0, 1)
    assert not answer.admissible and answer.room == 0
    assert answer.full_buffers == (0, 1)
    # v_traj 0 never gets room back (its window only shrinks); after buffer 0, version 1 has buffer 2 too
    assert answer.consume_through == 0 and answer.then_version == 1 and answer.then_room == 2
    assert "buffers 0..1 hold 4 groups in 4 slots" in answer.reason and "consume buffer 0 first" in answer.reason
    for g in "ab":
        ledger.occupy(g)
    ledger.consume()
    stale = ledger.what_if(0, 1)
    assert stale.full_buffers == (1,) and stale.consume_through is None and stale.then_version == 1
    assert stale.then_room == ledger.admissible(1) == 2 and "v_traj 1 has room for 2 now" in stale.reason


def test_what_if_for_a_version_not_produced_yet_or_too_stale_or_too_many() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2))
    future = ledger.what_if(2, 2)
    assert not future.admissible and future.room == 0 and future.consume_through == 1 and future.then_version == 2
    assert "does not exist yet" in future.reason
    far = ledger.what_if(2**62, 1)  # the answer stays small however far ahead the version is
    assert far.consume_through == 2**62 - 1 and far.then_version == 2**62 and "buffers 0.." in far.reason
    for step in range(3):
        ledger.reserve(f"s{step}", step)
        ledger.reserve(f"t{step}", step)
        ledger.occupy(f"s{step}")
        ledger.occupy(f"t{step}")
        ledger.consume()
    stale = ledger.what_if(1, 1)
    assert stale.room == 0 and "too stale" in stale.reason and stale.then_version == 3
    never = ledger.what_if(3, 5)
    assert never.then_version is None and "a window holds 4 groups" in never.reason


def test_what_if_refuses_bad_input_with_its_code() -> None:
    ledger = Ledger(LedgerParams(eta=1, batch_size=2))
    with pytest.raises(LedgerError) as bad_version:
        ledger.what_if(-1, 1)
    assert bad_version.value.code == "invalid_version"
    with pytest.raises(LedgerError) as bad_count:
        ledger.what_if(0, 0)
    assert bad_count.value.code == "invalid_request"
