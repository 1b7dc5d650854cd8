"""Protocol invariants of the ledger under random operation sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import run_ledger_ops

from staleflow.config.manager import LedgerParams
from staleflow.ledger import EntryStatus, GroupFate, Ledger, LedgerError


def edf_feasible(windows: list[tuple[int, int]], capacities: dict[int, int]) -> bool:
    """Can unit entries with windows [lo, hi] be assigned to buffers of these capacities?

    Earliest-deadline-first over buffers in order is optimal for unit jobs with integer release
    times and deadlines, so it is an exact oracle. It assumes nothing about the window shapes.
    """
    pending = sorted(windows)
    released: list[int] = []  # deadlines of released, unassigned entries
    i = 0
    for b in sorted(capacities):
        while i < len(pending) and pending[i][0] <= b:
            released.append(pending[i][1])
            i += 1
        released.sort()
        if released and released[0] < b:
            return False
        del released[: capacities[b]]
    return i == len(pending) and not released


def oracle_admissible(ledger: Ledger, v: int) -> int:
    """Largest n such that all live entries plus n new ones with V_traj = v can be placed."""
    t, eta, C = ledger.train_version, ledger.params.eta, ledger.capacity
    caps = {b: C for b in range(t, t + eta + 1)}
    sealed = set(ledger.sealed)
    if sealed:
        caps[t] = 0  # the sealed buffer holds exactly its batch
    windows = [(max(e.v_traj, t), e.deadline) for e in ledger.entries() if e.group_id not in sealed]
    n = 0
    while n <= C * (eta + 1) and edf_feasible(windows + [(max(v, t), v + eta)] * (n + 1), caps):
        n += 1
    return n


def oracle_ready(ledger: Ledger) -> bool:
    """Can B occupied entries sit in buffer t while everything else still fits?"""
    t, eta, B, C = ledger.train_version, ledger.params.eta, ledger.params.batch_size, ledger.capacity
    occupied = [e for e in ledger.entries() if e.status is EntryStatus.OCCUPIED]
    if len(occupied) < B:
        return False
    # pick the B earliest-deadline occupants for buffer t (an exchange argument makes this optimal)
    occupied.sort(key=lambda e: e.deadline)
    chosen = {e.group_id for e in occupied[:B]}
    rest = [(max(e.v_traj, t + 1), e.deadline) for e in ledger.entries() if e.group_id not in chosen]
    caps = {b: C for b in range(t + 1, t + eta + 1)}
    return edf_feasible(rest, caps) if rest else True


class LedgerMachine(RuleBasedStateMachine):
    @initialize(
        eta=st.integers(0, 4),
        batch=st.integers(1, 4),
        redundancy=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    )
    def setup(self, eta: int, batch: int, redundancy: float) -> None:
        self.ledger = Ledger(LedgerParams(eta=eta, batch_size=batch, batch_redundancy=redundancy))
        self.next_id = 0
        self.admitted: dict[str, int] = {}  # group -> v_traj
        self.consumed: dict[str, int] = {}  # group -> buffer version trained
        self.aborted: set[str] = set()
        self.versions_seen = [0]

    # -- operations --------------------------------------------------------------------

    @rule(offset=st.integers(-5, 0))
    def reserve(self, offset: int) -> None:
        t = self.ledger.train_version
        v = max(0, t + offset)
        expected = oracle_admissible(self.ledger, v)
        assert self.ledger.admissible(v) == expected, "admission must be exactly maximal"
        g = f"g{self.next_id}"
        self.next_id += 1
        try:
            tr = self.ledger.reserve(g, v)
        except LedgerError as e:
            assert e.code == "not_admissible" and expected == 0
            return
        assert expected >= 1
        self.admitted[g] = v
        assert tr.buffer is not None and v <= tr.buffer <= v + self.ledger.params.eta
        self._record_cancelled(tr.cancelled)

    @precondition(lambda self: any(e.status is EntryStatus.RESERVED for e in self.ledger.entries()))
    @rule(data=st.data())
    def occupy(self, data: st.DataObject) -> None:
        reserved = [e.group_id for e in self.ledger.entries() if e.status is EntryStatus.RESERVED]
        g = data.draw(st.sampled_from(reserved))
        tr = self.ledger.occupy(g)
        self._record_cancelled(tr.cancelled)

    @precondition(lambda self: bool(self.ledger.entries()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        g = data.draw(st.sampled_from([e.group_id for e in self.ledger.entries()]))
        tr = self.ledger.abort(g)
        self.aborted.add(g)
        self._record_cancelled(tr.cancelled)

    @rule()
    def consume(self) -> None:
        ready = oracle_ready(self.ledger) or bool(self.ledger.sealed)
        no_reservations = not any(e.status is EntryStatus.RESERVED for e in self.ledger.entries())
        t = self.ledger.train_version
        try:
            tr = self.ledger.consume()
        except LedgerError as e:
            assert e.code == "not_ready"
            # liveness: with nothing outstanding, a placeable Ready buffer is always consumable
            assert not (no_reservations and ready), "trainer deadlocked on a consumable buffer"
            return
        assert tr.consumed is not None and len(tr.consumed) == self.ledger.params.batch_size
        for g in tr.consumed:
            assert g not in self.consumed, "consumed twice"
            self.consumed[g] = t
        self.versions_seen.append(self.ledger.train_version)
        self._record_cancelled(tr.cancelled)

    def _record_cancelled(self, cancelled: list[str]) -> None:
        for g in cancelled:
            assert g in self.admitted and g not in self.aborted and g not in self.consumed
            self.aborted.add(g)

    @rule(offset=st.integers(-5, 2), count=st.integers(1, 6))
    def what_if(self, offset: int, count: int) -> None:
        """The what-if is exact where it says "now", consistent with itself, and changes nothing."""
        led = self.ledger
        before = (led.train_version, led.entries(), led.buffers(), led.sealed, led.counts(), led.admission())
        version = max(0, led.train_version + offset)
        answer = led.what_if(version, count)
        assert (led.train_version, led.entries(), led.buffers(), led.sealed, led.counts(), led.admission()) == before
        assert answer.room == (oracle_admissible(led, version) if version <= led.train_version else 0)
        assert answer.admissible == (count <= answer.room)
        if answer.admissible:
            assert answer.then_version is None and answer.consume_through is None
        elif answer.then_version is not None:
            assert answer.then_version >= version and answer.then_room >= count
            if answer.then_version > led.train_version:
                assert answer.consume_through == answer.then_version - 1
            else:
                assert answer.consume_through is None
                assert answer.then_room == oracle_admissible(led, answer.then_version)
        else:
            assert count > led.capacity * (led.params.eta + 1)
        for b in answer.full_buffers:
            view = next(v for v in led.buffers() if v.version == b)
            assert len(view.entries) >= view.capacity

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def safety(self) -> None:
        eta = self.ledger.params.eta
        for g, buf in self.consumed.items():
            v = self.admitted[g]
            assert v <= buf <= v + eta, f"{g}: v_traj {v} trained at {buf} with eta {eta}"
            if eta == 0:
                assert v == buf, "eta=0 must be on-policy"

    @invariant()
    def exactly_once(self) -> None:
        live = {e.group_id for e in self.ledger.entries()}
        assert live.isdisjoint(self.consumed) and live.isdisjoint(self.aborted)
        assert not (set(self.consumed) & self.aborted)
        assert live | set(self.consumed) | self.aborted == set(self.admitted)
        for g in self.consumed:
            assert self.ledger.fate(g) is GroupFate.CONSUMED
        for g in self.aborted:
            assert self.ledger.fate(g) in (GroupFate.ABORTED, GroupFate.SURPLUS)

    @invariant()
    def buffers_respect_windows(self) -> None:
        views = self.ledger.buffers()
        placed = [e.group_id for view in views for e in view.entries]
        assert sorted(placed) == sorted(e.group_id for e in self.ledger.entries()), "every live entry placed once"
        eta = self.ledger.params.eta
        for view in views:
            assert len(view.entries) <= view.capacity
            for e in view.entries:
                assert e.v_traj <= view.version <= e.v_traj + eta
        assert self.versions_seen == sorted(self.versions_seen), "trainer version never goes backwards"

    @invariant()
    def occupied_first(self) -> None:
        """No reserved entry sits in an earlier buffer than an occupied entry it could swap with."""
        views = self.ledger.buffers()
        for i, early in enumerate(views):
            for late in views[i + 1 :]:
                for r in early.entries:
                    if r.status is not EntryStatus.RESERVED:
                        continue
                    for o in late.entries:
                        if o.status is EntryStatus.OCCUPIED and r.v_traj + self.ledger.params.eta >= late.version:
                            raise AssertionError(f"reserved {r.group_id} could swap with occupied {o.group_id}")


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@given(
    eta=st.integers(0, 4),
    batch=st.integers(1, 3),
    ops=st.lists(st.tuples(st.sampled_from("rrroac"), st.integers(0, 50)), max_size=60),
)
@settings(max_examples=200, deadline=None)
def test_no_reachable_state_deadlocks_the_trainer(eta: int, batch: int, ops: list[tuple[str, int]]) -> None:
    """From any reachable state, finishing every outstanding reservation lets training progress."""
    ledger = run_ledger_ops(Ledger(LedgerParams(eta=eta, batch_size=batch)), ops)
    for e in ledger.entries():
        if e.status is EntryStatus.RESERVED:
            ledger.occupy(e.group_id)
    # occupied entries alone: consume until fewer than B remain, and never get stuck
    while len(ledger.entries()) >= batch:
        before = ledger.train_version
        ledger.consume()
        assert ledger.train_version == before + 1
    # top the buffer up with fresh on-policy groups: it becomes Ready again
    for i in range(batch - len(ledger.entries())):
        ledger.reserve(f"fresh{i}", ledger.train_version)
        ledger.occupy(f"fresh{i}")
    assert ledger.consume().consumed is not None
