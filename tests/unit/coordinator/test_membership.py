"""The instance lifecycle as a state machine: hypothesis plays an instance process (answering,
silent, busy, idle, stalled, restarted) and the trajectory server (up or down), drives the
membership rules the way the coordinator's cycle does, and checks every decision against the
rules' intent: failed exactly when silent or stalled, never for being slow or idle; a restarted
process rejoins once its predecessor's work is released."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from staleflow.coordinator.membership import TRANSITIONS, Action, InstanceStatus, Liveness, Membership

FAILURE_TIMEOUT, STALL_TIMEOUT = 10.0, 30.0
S = InstanceStatus


class RecordedLiveness(Liveness):
    """Liveness that keeps every status it moved through."""

    def move(self, to: InstanceStatus) -> None:
        super().move(to)
        self.history.append(to)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rules = Membership(FAILURE_TIMEOUT, STALL_TIMEOUT)
        self.now = 0.0
        self.live = RecordedLiveness(last_seen=0.0, last_progress=0.0)
        self.live.history = [self.live.status]
        # the instance process, as the oracle sees it
        self.boot, self.version, self.ps_version = "boot-0", 0, 0
        self.running, self.tokens = False, 0
        self.answered_at = self.progressed_at = 0.0
        self.ts_up = True

    # -- the coordinator's cycle, as the service runs it

    def _release(self, actions: list[Action]) -> None:
        if Action.RELEASE in actions and self.ts_up:
            self.rules.released(self.live)

    def _rejoin(self, boot: str) -> bool:
        self._release(self.rules.begin_rejoin(self.live))
        if not self.live.released:
            return False
        self.rules.rejoin(self.live, boot, self.now)
        return True

    def _cycle(self, answers: bool) -> None:
        live, before, boot_before = self.live, self.live.status, self.live.boot_id
        if live.status is S.FAILED and not live.released and self.ts_up:
            self.rules.released(live)
        if self.rules.to_probe(live, self.now):
            if live.status is S.FAILED:
                if answers and self.rules.restarted(live, self.boot):
                    self._rejoin(self.boot) and self._observe()
            elif not answers:
                self._release(self.rules.silent(live, self.now)[0])
            elif not self.rules.restarted(live, self.boot) or self._rejoin(self.boot):
                live.last_seen = self.now
                if live.status is not S.JOINING or self.ts_up:  # orphans go back before it joins
                    self._release(self._observe())
        if before is S.FAILED and live.status is not S.FAILED:  # out of failed only as a new process
            assert live.boot_id == self.boot != boot_before

    def _observe(self) -> list[Action]:
        mark = (self.tokens, self.running, self.version)
        actions, _ = self.rules.seen(self.live, self.now, mark, self.running)
        self.rules.join(self.live, self.version, self.ps_version, idle=not self.running)
        return actions

    # -- what happens between cycles

    @rule(answers=st.booleans(), dt=st.sampled_from([0.5, 4.0, 9.0, 16.0]), progress=st.booleans(),
          running=st.booleans(), cycles=st.integers(1, 4))
    def cycles(self, answers: bool, dt: float, progress: bool, running: bool, cycles: int) -> None:
        """Time passes, cycle after cycle: the instance answers each snapshot request (busy or idle,
        with or without progress) or stays silent."""
        for _ in range(cycles):
            if answers:
                self.answered(dt, progress, running)
            else:
                self.silent(dt)

    def answered(self, dt: float, progress: bool, running: bool) -> None:
        self.now += dt
        self.running = running
        if progress or not running:
            self.tokens += int(progress)
            self.progressed_at = self.now
        was_failed = self.live.status is S.FAILED
        self._cycle(answers=True)
        self.answered_at = self.now
        if not was_failed and self.live.status is S.FAILED:  # only a stall fails an answering instance
            assert running and not progress and self.now - self.live.last_progress > STALL_TIMEOUT
        if not running:
            assert self.live.status is not S.FAILED or was_failed  # idle is never stalled
        elif self.live.status in (S.LIVE, S.SYNCING):  # busy: failed once stalled too long
            assert self.now - self.live.last_progress <= STALL_TIMEOUT  # (joining: waits, not judged)

    def silent(self, dt: float) -> None:
        self.now += dt
        was = self.live.status
        self._cycle(answers=False)
        silence = self.now - self.live.last_seen
        if was is not S.FAILED:
            assert (self.live.status is S.FAILED) == (silence > FAILURE_TIMEOUT)

    @rule()
    def restarts(self) -> None:
        """A supervisor replaced the process: a new boot id, nothing running, the same version."""
        self.boot = f"boot-{int(self.boot.split('-')[1]) + 1}"
        self.running = False
        self.now += 1.0
        self._cycle(answers=True)
        if self.live.status is not S.FAILED:  # it takes part again only as the new process
            assert self.live.boot_id == self.boot

    @rule(up=st.booleans())
    def trajectory_server(self, up: bool) -> None:
        self.ts_up = up

    @rule()
    def newer_weights(self) -> None:
        self.ps_version += 1
        if self.live.status is S.LIVE:
            self.rules.sync_started(self.live)

    @rule()
    def pull_ends(self) -> None:
        if self.live.status is S.SYNCING:
            self.version = self.ps_version
        self.rules.sync_ended(self.live)

    # -- always

    @invariant()
    def only_an_instance_whose_work_is_back_takes_part(self) -> None:
        if self.live.status is not S.FAILED:
            assert self.live.released

    @invariant()
    def every_change_is_in_the_table(self) -> None:
        history = self.live.history
        for before, after in zip(history, history[1:], strict=False):
            assert before is after or (before, after) in TRANSITIONS


LifecycleMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_instance_lifecycle = LifecycleMachine.TestCase


def test_a_pull_only_starts_from_live() -> None:
    live = Liveness(status=S.FAILED)
    try:
        Membership(1, 1).sync_started(live)
    except ValueError as exc:
        assert "cannot go from failed to syncing" in str(exc)
    else:
        raise AssertionError("a failed instance started a pull")
