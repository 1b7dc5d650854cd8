"""Where a real engine's time goes (the paper's Table 3), measured, not modelled.

Two halves, one per process of a vLLM instance:

* ``StepAccountant`` runs inside vLLM's worker (the engine-core process). It times every model
  step (``execute_model`` through ``sample_tokens``) and splits it by the tokens the scheduler put
  into it: *prefill* (the prompt of a fresh trajectory), *re-prefill* (the context of a resumed
  trajectory, or of one vLLM preempted and now recomputes) and *decode* (one token per running
  trajectory). A step that mixes them is apportioned by token count.
* ``EngineTimeline`` runs in the instance server. It tells, from the engine adapter's own state,
  when the instance held trajectories (busy), loaded weights (Pull) or held nothing (idle).

``VersionSwitches`` (in the worker too) finds, for every request that kept running through a
weight update, how many of its tokens the old weights had generated: the scheduler's own count
when the request is next scheduled (nothing runs while generation is paused for the load).

``breakdown`` combines them into parts that add up to the instance's rollout time exactly:
decode + prefill + re-prefill (step time) + overhead (busy, but between steps: scheduling, output
processing, waiting for a CPU on a shared host) + pull + idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("prefill", "reprefill", "decode")
RESUME_MARK = "resume|"
"""Request ids of resumed trajectories start with this, so the worker can tell re-prefill apart."""


def is_resume(request_id: str) -> bool:
    return request_id.startswith(RESUME_MARK)


@dataclass
class StepTotals:
    """The worker's running totals (JSON-able, returned through ``collective_rpc``)."""

    steps: int = 0
    step_seconds: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    prefix_cached_tokens: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "reprefill": 0})
    mixed_steps: int = 0  # steps holding more than one phase (apportioned by tokens)
    # steps that only decoded and their seconds: the engine's real decode step latency, which the
    # snapshot reports (``EngineSnapshot.decode_steps`` / ``decode_seconds``) against the cost model's
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    preempted_recomputes: int = 0  # requests vLLM preempted and recomputed
    longest_step_seconds: float = 0.0
    first_step_started: float | None = None  # time.monotonic() in the engine-core process
    weight_loads: int = 0
    weight_load_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def external_id(request_id: str, known: Mapping[str, object]) -> str | None:
    """The id a request was submitted with, among ``known``: vLLM may suffix ``-<8 characters>``."""
    if request_id in known:
        return request_id
    head = request_id.rpartition("-")[0]
    return head if head in known else None


class VersionSwitches:
    """Where a new model version took over requests that kept running through a weight update.

    ``expect(ids, version)`` while generation is paused for the load; then the first scheduler
    output that schedules one of them tells how many output tokens it has (all the old weights'),
    and from there on the tokens are ``version``'s: a mark ``(position, version)``, positions
    counting this request's output tokens. Duck-typed on the scheduler output like
    ``StepAccountant``."""

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}  # submitted id -> the version that takes over at its next step
        self._marks: dict[str, list[tuple[int, int]]] = {}

    def expect(self, request_ids: list[str], version: int) -> None:
        for request_id in request_ids:
            self._pending[request_id] = version

    def observe(self, scheduler_output: Any) -> None:
        if not self._pending:
            return
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            if (known := external_id(req_id, self._pending)) is not None:
                del self._pending[known]  # it finished on the old weights
        for new in scheduler_output.scheduled_new_reqs:  # first scheduled since the load: nothing generated yet
            self._mark(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, generated in zip(cached.req_ids, cached.num_output_tokens, strict=False):
            self._mark(req_id, generated)

    def _mark(self, req_id: str, generated: int) -> None:
        if (known := external_id(req_id, self._pending)) is not None:
            self._marks.setdefault(known, []).append((int(generated), self._pending.pop(known)))

    def marks(self, request_ids: list[str], forget: bool) -> dict[str, list[tuple[int, int]]]:
        """The marks of these requests (those without any are left out); ``forget``: the requests are
        gone from the front end, so are their marks and what was still expected of them."""
        out = {r: list(self._marks[r]) for r in request_ids if r in self._marks}
        if forget:
            for r in request_ids:
                self._marks.pop(r, None)
                self._pending.pop(r, None)
        return out


class StepAccountant:
    """Times model steps and classifies their tokens from vLLM's ``SchedulerOutput``.

    ``begin(scheduler_output)`` before the model runs, ``end()`` once the step's tokens are
    sampled. Duck-typed on the scheduler output (``scheduled_new_reqs``, ``scheduled_cached_reqs``,
    ``num_scheduled_tokens``, ``finished_req_ids``), so it is tested without vLLM.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, monotonic: Callable[[], float] = time.monotonic):
        self.totals = StepTotals()
        self.switches = VersionSwitches()
        self._clock = clock
        self._monotonic = monotonic
        self._phase_of: dict[str, str] = {}  # request id -> prefill | reprefill, while it is on the engine
        self._open: tuple[float, dict[str, int]] | None = None

    def begin(self, scheduler_output: Any) -> None:
        self.switches.observe(scheduler_output)
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._phase_of.pop(req_id, None)
        tokens = self.classify(scheduler_output)
        if not any(tokens.values()):
            self._open = None  # nothing scheduled: no model step
            return
        if self.totals.first_step_started is None:
            self.totals.first_step_started = self._monotonic()
        self._open = (self._clock(), tokens)

    def end(self) -> None:
        if self._open is None:
            return
        started, tokens = self._open
        self._open = None
        elapsed = max(0.0, self._clock() - started)
        total = sum(tokens.values())
        t = self.totals
        t.steps += 1
        t.step_seconds += elapsed
        t.longest_step_seconds = max(t.longest_step_seconds, elapsed)
        t.mixed_steps += sum(1 for n in tokens.values() if n) > 1
        if tokens["decode"] == total:
            t.decode_steps += 1
            t.decode_step_seconds += elapsed
        for phase, n in tokens.items():
            t.tokens[phase] += n
            t.seconds[phase] += elapsed * n / total

    def abandon(self) -> None:
        """The step raised: it is not counted."""
        self._open = None

    def weights_loaded(self, seconds: float) -> None:
        self.totals.weight_loads += 1
        self.totals.weight_load_seconds += seconds

    def classify(self, scheduler_output: Any) -> dict[str, int]:
        tokens: dict[str, int] = dict.fromkeys(PHASES, 0)
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        fresh = set()
        for new in scheduler_output.scheduled_new_reqs:
            phase = "reprefill" if is_resume(new.req_id) else "prefill"
            self._phase_of[new.req_id] = phase
            fresh.add(new.req_id)
            self.totals.prefix_cached_tokens[phase] += int(getattr(new, "num_computed_tokens", 0) or 0)
        cached = scheduler_output.scheduled_cached_reqs
        output_tokens = dict(zip(cached.req_ids, cached.num_output_tokens, strict=False))
        recomputed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, n in scheduled.items():
            if req_id in fresh:
                phase = self._phase_of[req_id]
            elif output_tokens.get(req_id) == 0:  # a chunked prompt continues
                phase = self._phase_of.get(req_id, "prefill")
            elif req_id in recomputed or n > 1:  # preempted earlier: its whole context again
                phase = "reprefill"
                self.totals.preempted_recomputes += req_id in recomputed
            else:
                phase = "decode"
            tokens[phase] += n
        return tokens


class EngineTimeline:
    """Busy / pull / idle intervals of one instance, from the engine adapter's point of view."""

    IDLE, BUSY, PULL = "idle", "busy", "pull"

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.started = clock()
        self.state = self.IDLE
        self._since = self.started
        self.seconds = {self.IDLE: 0.0, self.BUSY: 0.0, self.PULL: 0.0}
        self.pulls = 0

    def switch(self, state: str) -> None:
        if state not in self.seconds:
            raise ValueError(f"unknown state {state!r}")
        now = self._clock()
        self.seconds[self.state] += now - self._since
        self.state, self._since = state, now
        if state == self.PULL:
            self.pulls += 1

    def holding(self, has_work: bool) -> None:
        """The adapter's trajectories changed: busy if it holds any (a Pull in progress stays a Pull)."""
        if self.state != self.PULL:
            target = self.BUSY if has_work else self.IDLE
            if target != self.state:
                self.switch(target)

    def totals(self) -> tuple[float, dict[str, float]]:
        """(wall seconds since start, seconds per state), the open interval included."""
        now = self._clock()
        seconds = dict(self.seconds)
        seconds[self.state] += now - self._since
        return now - self.started, seconds


def breakdown(wall: float, states: Mapping[str, float], steps: StepTotals | Mapping[str, Any]) -> dict[str, float]:
    """Seconds per part; they add up to ``wall`` exactly.

    Step time is measured in the engine-core process and the busy intervals in the server; a
    step still finishing as its last trajectory is stopped can run into time the server already
    counts as idle, so busy is at least the step time, and idle is what is left.
    """
    step_seconds = steps.seconds if isinstance(steps, StepTotals) else steps["seconds"]
    compute = {phase: float(step_seconds.get(phase, 0.0)) for phase in PHASES}
    pull = float(states.get(EngineTimeline.PULL, 0.0))
    busy = max(float(states.get(EngineTimeline.BUSY, 0.0)), sum(compute.values()))
    overhead = busy - sum(compute.values())
    idle = wall - pull - busy
    if idle < 0:  # clocks of two processes read a few microseconds apart
        overhead = max(0.0, overhead + idle)
        idle = 0.0
    parts = {**compute, "overhead": overhead, "pull": pull, "idle": idle}
    rest = wall - sum(parts.values())  # float rounding only
    parts["idle"] += rest
    return parts


__all__ = ["PHASES", "RESUME_MARK", "EngineTimeline", "StepAccountant", "StepTotals", "VersionSwitches", "breakdown",
           "external_id", "is_resume"]
