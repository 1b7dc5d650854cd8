"""The simulated rollout engine: a vLLM-like instance driven by the paper's cost model.

This is a simulation, not a mock: it reproduces the behaviour coordination strategies react to
(continuous batching, per-step latency that grows with the KV cache, KV-budget preemption with
recompute, re-prefill cost of interrupts and migrations, blocking weight loads) so strategies can be
compared on a laptop, in CI or in what-if studies at paper scale.

Model
-----
* A decode step generates one token for every running trajectory and takes
  ``CostModel.step_latency(kv, n)`` (Appendix B, Eq. 11) times an optional seeded noise factor,
  plus the prefill of trajectories admitted in that step: ``prefill_seconds_per_token`` per context
  token and ``prefill_attention_seconds x c^2 / 2`` for a context of ``c`` tokens (causal
  attention), times the instance's persistent ``slowdown``
  (new ones, resumed ones and re-admitted preempted ones all re-prefill prompt + response).
* KV budget ``M`` (``CostModel.kv_budget``, KV units, ``k5`` units per token). Before each step every
  running trajectory needs room for one more token; when it is missing, the most recently admitted
  trajectories are preempted to the front of the waiting queue (vLLM's recompute preemption). The
  waiting queue is admitted FIFO, head-of-line, when the head's context fits, at most
  ``max_running`` at a time, and not in a step that preempted.
* A Pull (``load_weights``) interrupts every running and waiting trajectory, hands them back,
  clears ``complete_trajs``, sets the version and blocks generation for
  ``pull_latency_s + size / pull_bandwidth``. A Pull that keeps them (``keep_running``) lets the
  step in flight finish on the old weights, blocks generation as long, and the trajectories then
  continue where they were with their KV cache: nothing is re-prefilled, and their tokens from
  the load on are the new version's.
* Response lengths come from the workload model keyed by (group id, trajectory id), and tokens and
  log-probs are pseudo-random functions of (trajectory id, position, seed): a trajectory interrupted
  and resumed anywhere ends exactly as an uninterrupted one.

Time
----
``SimCore`` is synchronous and event-driven on a virtual clock: ``advance_to(t)`` executes every
step that ends by ``t``, jumping analytically over runs of steps in which nothing but the KV cache
changes, so its cost grows with the number of events (admissions, completions, preemptions), not
tokens. A step in flight at ``t`` is frozen: commands arriving mid-step take effect at the next
step boundary, as in vLLM's engine loop (an interrupted trajectory loses the in-flight token).
``SimEngine`` wraps a core behind the async ``RolloutEngine`` interface on either that virtual
clock (advanced explicitly) or on real time scaled by ``speed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from staleflow.config.engines import Clock, SimParams
from staleflow.engines.base import (
    AbortResult,
    CompletedTrajectory,
    CompletionStream,
    EngineError,
    EngineSnapshot,
    FinishReason,
    InterruptResult,
    PartialTrajectory,
    Progress,
    RolloutEngine,
    SimWeights,
    TrajectoryRequest,
    VersionMarks,
    WeightsFromParams,
    WeightsRef,
    check_new_ids,
    check_version,
    extend_by_marks,
    progress_start,
    with_response,
)
from staleflow.workload import WorkloadModel, pseudo_tokens, stable_normal

PULL_WAIT_S = 120.0
"""How long a pull waits for a version its server is still receiving (a relay copying it)."""


def pull_version_bytes(weights: WeightsFromParams) -> None:
    """Pull ``weights``' version from its server, every chunk verified, and drop the bytes. A
    version the server's copy was dropped of is pulled from its holders (``sources="ros"``); a
    refusal raises ``EngineError`` with the server's code (``version_unavailable``: nobody holds
    it any more, the coordinator then names a version that exists)."""
    import httpx

    from staleflow.api.base import ServiceError
    from staleflow.errors import ErrorCode
    from staleflow.transports.client import ParamsClient

    try:
        with ParamsClient(weights.url, timeout=PULL_WAIT_S + 30) as params:
            try:
                params.pull(weights.version, weights.transport, wait_s=PULL_WAIT_S)
            except ServiceError as exc:
                if exc.code is not ErrorCode.VERSION_HELD_BY_PEERS:
                    raise
                params.pull(weights.version, "http", sources="ros")
    except ServiceError as exc:
        raise EngineError(exc.code or ErrorCode.WEIGHTS_LOAD_FAILED, exc.detail) from None
    except (OSError, httpx.HTTPError) as exc:  # the server is down or restarting: the coordinator pulls again
        raise EngineError(ErrorCode.WEIGHTS_LOAD_FAILED, f"pulling version {weights.version} from {weights.url}: {exc}") from None


class _Live:
    """A trajectory on the instance. Its token count advances lazily with the step counter."""

    __slots__ = ("request", "target", "finish", "generated", "admitted_step", "finish_step", "running", "marks")

    def __init__(self, request: TrajectoryRequest, target: int, finish: FinishReason, version: int):
        self.request = request
        self.target = target
        self.finish = finish
        self.generated = request.num_generated  # tokens as of the last admission / removal
        self.admitted_step = 0
        self.finish_step = 0
        self.running = False
        self.marks = [(request.num_generated, version)]  # which version generates from which position


@dataclass(frozen=True)
class SimFinished:
    """A trajectory that left the instance finished or aborted; its tokens are built on demand."""

    request: TrajectoryRequest
    num_tokens: int
    marks: VersionMarks
    finish_reason: FinishReason
    time: float
    workload: WorkloadModel

    @property
    def traj_id(self) -> str:
        return self.request.traj_id

    def trajectory(self) -> CompletedTrajectory:
        stop = self.finish_reason is FinishReason.STOP
        fields = _grow(self.request, self.num_tokens, self.marks, self.workload, stop=stop)
        return CompletedTrajectory(**fields, finish_reason=self.finish_reason)


def _grow(request: TrajectoryRequest, num_tokens: int, marks: VersionMarks, workload: WorkloadModel,
          stop: bool = False) -> dict:
    """Fields of ``request`` grown to ``num_tokens`` response tokens (EOS last when ``stop``).

    The tokens are a function of (trajectory id, position, workload seed) only, so every instance
    produces the same stream for a trajectory.
    """
    tokens, logprobs = pseudo_tokens(
        request.traj_id, workload.seed, request.num_generated, num_tokens, workload.vocab_size, workload.eos_token_id
    )
    if stop and tokens:
        tokens[-1] = workload.eos_token_id
    return with_response(request, tokens, logprobs, marks)


@dataclass
class SimStats:
    """Where the instance's time went (cf. paper Table 3) and what it produced."""

    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    pull_seconds: float = 0.0
    decode_steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    completed: int = 0
    interrupted: int = 0
    aborted: int = 0
    pulls: int = 0
    kv_seconds: float = 0.0  # KV units held x seconds generating: the mean KV use while busy is this over the seconds


class SimCore:
    """One simulated instance on a virtual clock (synchronous; see the module docstring).

    Commands act at ``now``; a driver moves ``now`` forward with ``advance_to`` and may use
    ``next_event_time`` to jump straight to the next admission, completion, preemption or end of a
    Pull. Finished trajectories accumulate until ``pop_finished``.
    """

    def __init__(self, params: SimParams | None = None, instance_id: str = "sim"):
        self.params = params or SimParams()
        self.instance_id = instance_id
        self.cost = self.params.cost
        self.version = self.params.initial_version
        self.now = 0.0
        self.stats = SimStats()
        self._clock = 0.0  # start of the step in flight, or when the instance went idle
        self._step_end: float | None = None  # end of the frozen step in flight
        self._step_prefill = 0.0  # prefill share of the step in flight
        self._step_admitted: dict[str, int] = {}  # admitted at the start of the step in flight: context tokens
        self._step_preempted = False
        self._pull_end: float | None = None
        self._kept_pull: float | None = None  # a Pull that keeps the trajectories: its seconds, once the step ends
        self._weights = self.version  # the version whose weights generate now
        self._steps = 0  # decode steps completed: the lazy token counter of running trajectories
        self._kv_tokens = 0  # context tokens held by running trajectories
        self._live: dict[str, _Live] = {}
        self._running: dict[str, _Live] = {}  # admission order: preemption pops the newest
        self._waiting: deque[str] = deque()
        self._completions: list[tuple[int, int, str]] = []  # heap of (finish step, tiebreak, id)
        self._tiebreak = 0
        self._complete_ids: dict[str, None] = {}
        self._finished: list[SimFinished] = []
        self._noise_block = -1
        self._noise_factor = 1.0

    # ------------------------------------------------------------------ queries

    @property
    def kv_units(self) -> float:
        return self.cost.kv_units(self._kv_tokens)

    @property
    def busy(self) -> bool:
        """Generating, loading weights, or holding work."""
        return self._step_end is not None or self._pull_end is not None or bool(self._live)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            kv_cache=round(self.kv_units),
            run_trajs=tuple(self._running),
            wait_trajs=tuple(self._waiting),
            complete_trajs=tuple(self._complete_ids),
            inst_version=self.version,
            loading_weights=self._pull_end is not None or self._kept_pull is not None,
            time=self.now,
            decode_steps=self.stats.decode_steps,
            decode_seconds=self.stats.decode_seconds,
            kv_usage=self.kv_units / self.cost.kv_budget,
            generated={traj_id: self._generated_now(live) for traj_id, live in self._live.items()},
        )

    def generated(self, traj_id: str) -> int:
        """Response tokens the trajectory holds now (KeyError if it is not on the instance)."""
        return self._generated_now(self._live[traj_id])

    def progress(self, reported: Mapping[str, int], min_new: int = 1) -> list[Progress]:
        """See ``RolloutEngine.progress``; tokens are built only from the reported position on."""
        out = []
        workload = self.params.workload
        for traj_id, live in self._live.items():
            request, now = live.request, self._generated_now(live)
            start = progress_start(reported, request, now, min_new)
            if start is None:
                continue
            tokens, logprobs = pseudo_tokens(traj_id, workload.seed, start, now, workload.vocab_size,
                                             workload.eos_token_id)
            segments = extend_by_marks(request.segments, live.marks, request.num_generated, now)
            out.append(Progress(traj_id, start, tuple(tokens), tuple(logprobs), segments))
        return out

    def pop_finished(self) -> list[SimFinished]:
        finished, self._finished = self._finished, []
        return finished

    # ------------------------------------------------------------------ commands

    def route(self, requests: Sequence[TrajectoryRequest]) -> None:
        check_new_ids(requests, self._live)
        check_version(requests, self.version)
        budget_tokens = self.cost.kv_budget / self.cost.k5
        for r in requests:
            if len(r.prompt_ids) + r.sampling.max_tokens > budget_tokens:
                raise EngineError(
                    "exceeds_kv_budget",
                    f"trajectory {r.traj_id}: prompt {len(r.prompt_ids)} + max_tokens {r.sampling.max_tokens} "
                    f"tokens can never fit the KV budget of {budget_tokens:g} tokens",
                )
        for r in requests:
            live = _Live(r, *self._target(r), self._weights)
            self._live[r.traj_id] = live
            self._waiting.append(r.traj_id)
        self._reschedule()

    def interrupt(self, traj_ids: Iterable[str]) -> InterruptResult:
        taken, not_found = self._take(traj_ids)
        self.stats.interrupted += len(taken)
        return InterruptResult([self._partial(live) for live in taken], not_found)

    def abort(self, traj_ids: Iterable[str]) -> AbortResult:
        taken, not_found = self._take(traj_ids)
        for live in taken:
            self._finish(live, FinishReason.ABORT)
        self.stats.aborted += len(taken)
        return AbortResult([live.request.traj_id for live in taken], not_found)

    def load_weights(self, version: int, size_bytes: int | None = None,
                     keep_running: bool = False, seconds: float | None = None) -> list[PartialTrajectory]:
        """The Pull: interrupt everything (unless ``keep_running``), clear complete_trajs, block
        for the transfer time (``seconds`` when the caller knows it, e.g. a cluster whose pulls
        share a source; else ``SimParams.pull_seconds``)."""
        if version < self.version:
            raise EngineError("version_regression", f"cannot load version {version}: instance is at {self.version}")
        if size_bytes is not None and size_bytes < 0:
            raise EngineError("invalid_weights", f"size_bytes must be >= 0, got {size_bytes}")
        if seconds is not None and not seconds >= 0:
            raise EngineError("invalid_weights", f"a pull takes >= 0 seconds, got {seconds}")
        duration = self.params.pull_seconds(size_bytes) if seconds is None else seconds
        self.version = version
        self._complete_ids.clear()
        self.stats.pull_seconds += duration
        self.stats.pulls += 1
        if keep_running:
            if self._step_end is not None:  # it finishes on the old weights; the load follows it
                self._kept_pull = (self._kept_pull or 0.0) + duration
            else:
                self._pull_end = max(self.now, self._pull_end or self.now) + duration
                self._load(version)
            return []
        partials = self.interrupt([*self._running, *self._waiting]).partials
        start = max(self.now, self._pull_end or self.now, self._step_end or self.now)
        self._step_end = None
        self._pull_end = start + duration + (self._kept_pull or 0.0)
        self._kept_pull = None
        self._load(version)
        return partials

    def _load(self, version: int) -> None:
        """The new weights generate from here on: what each trajectory generates next is theirs."""
        self._weights = version
        for live in self._live.values():
            live.marks.append((self._generated_now(live), version))

    # ------------------------------------------------------------------ time

    def advance_to(self, t: float) -> None:
        """Run the instance until virtual time ``t`` (steps ending after ``t`` stay in flight)."""
        if not math.isfinite(t) or t < self.now:
            raise ValueError(f"time goes forward only, to a finite time: now {self.now}, asked {t}")
        while True:
            if self._pull_end is not None:
                if self._pull_end > t:
                    break
                self._clock, self._pull_end = self._pull_end, None
                self._begin_step()
                continue
            if self._step_end is None or self._step_end > t:
                break
            self.stats.prefill_tokens += sum(self._step_admitted.values())
            self._complete_steps(1, self._step_end - self._clock, self._step_prefill)
            if self._kept_pull is not None:
                self._step_end, self._pull_end, self._kept_pull = None, self._clock + self._kept_pull, None
                self._load(self.version)
                continue
            self._jump(t)
            self._begin_step()
        self.now = t
        if self._step_end is None and self._pull_end is None:
            self._clock = t

    def next_event_time(self) -> float | None:
        """When the next admission, completion, preemption or end of a Pull happens; None if idle."""
        if self._pull_end is not None:
            return self._pull_end
        if self._step_end is None:
            return None
        if self._kept_pull is not None:
            return self._step_end
        n = len(self._running)
        if n == 0:
            return self._step_end  # an emptied step ends; the waiting queue is admitted then
        kv_after = self._kv_tokens + n  # after the step in flight
        steps_left = self._min_remaining() - 1
        if steps_left == 0 or not self._uniform_from(kv_after, n):
            return self._step_end
        steps = min(steps_left, self._steps_before_preemption(kv_after, n))
        return self._step_end + self._time_for(kv_after, n, self._steps + 1, steps)

    # ------------------------------------------------------------------ internals: stepping

    def _begin_step(self, replan: bool = False) -> None:
        """At a step boundary: preempt or admit, then freeze the next step's latency.

        ``replan``: a command arrived at the very instant the step in flight began, so the step is
        planned again with it (commands issued at time t precede the step that starts at t).
        """
        if replan:
            self._step_admitted = {i: n for i, n in self._step_admitted.items() if i in self._running}
        else:
            self._step_admitted = {}
        preempted = self._preempt_to_fit() or (replan and self._step_preempted)
        if not preempted:  # vLLM admits nothing in a step that preempted
            self._step_admitted.update(self._admit())
        self._step_preempted = preempted
        n = len(self._running)
        if n == 0:
            self._step_end = None
            return
        decode = self._noise(self._steps) * self.cost.step_latency(self.kv_units, n)
        self._step_prefill = self._noise(self._steps) * sum(map(self._prefill_seconds, self._step_admitted.values()))
        self._step_end = self._clock + decode + self._step_prefill

    def _complete_steps(self, steps: int, seconds: float, prefill_seconds: float = 0.0) -> None:
        n = len(self._running)
        self.stats.kv_seconds += seconds * self.cost.kv_units(self._kv_tokens + (steps - 1) * n / 2)
        self._clock += seconds
        self._steps += steps
        self._kv_tokens += steps * n
        self.stats.decode_steps += steps
        self.stats.tokens_generated += steps * n
        self.stats.decode_seconds += seconds - prefill_seconds
        self.stats.prefill_seconds += prefill_seconds
        heap = self._completions
        while heap and heap[0][0] <= self._steps:
            finish_step, _, traj_id = heapq.heappop(heap)
            live = self._running.get(traj_id)
            if live is None or live.finish_step != finish_step:
                continue  # stale entry: the trajectory was removed or re-admitted
            self._remove(live)
            self._complete_ids[traj_id] = None
            self.stats.completed += 1
            self._finish(live, live.finish)

    def _jump(self, t: float) -> None:
        """Complete, in one go, the steps before ``t`` in which nothing but the KV cache changes."""
        block = self.params.noise_block_steps
        while (n := len(self._running)) and self._uniform_from(self._kv_tokens, n):
            steps = min(self._min_remaining(), self._steps_before_preemption(self._kv_tokens, n))
            if self.params.noise:
                steps = min(steps, block - self._steps % block)  # one noise factor per jump
            factor = self._noise(self._steps)
            kv = self.cost.kv_units(self._kv_tokens)
            steps = min(steps, self.cost.steps_within(kv, n, (t - self._clock) / factor))
            if steps == 0:
                return
            self._complete_steps(steps, factor * self.cost.decode_time(kv, n, steps))

    def _uniform_from(self, kv_tokens: int, n: int) -> bool:
        """At a boundary with this KV: would the next step start with no preemption or admission?"""
        if self.cost.kv_units(kv_tokens + n) > self.cost.kv_budget:
            return False
        return not self._can_admit_head(kv_tokens, n)

    def _steps_before_preemption(self, kv_tokens: int, n: int) -> int:
        """Steps that can run before the KV budget forces a preemption (>= 1 at a uniform boundary)."""
        budget_tokens = self.cost.kv_budget / self.cost.k5
        return max(1, math.floor((budget_tokens - kv_tokens) / n + 1e-9))

    def _time_for(self, kv_tokens: int, n: int, first_step: int, steps: int) -> float:
        """Seconds for ``steps`` uniform steps starting at step index ``first_step``."""
        total = 0.0
        block = self.params.noise_block_steps if self.params.noise else steps
        while steps > 0:
            chunk = min(steps, block - first_step % block) if self.params.noise else steps
            total += self._noise(first_step) * self.cost.decode_time(self.cost.kv_units(kv_tokens), n, chunk)
            kv_tokens += chunk * n
            first_step += chunk
            steps -= chunk
        return total

    def _prefill_seconds(self, context: int) -> float:
        p = self.params
        return p.prefill_seconds_per_token * context + p.prefill_attention_seconds * context * context / 2

    def _noise(self, step: int) -> float:
        """The latency factor of step ``step``: the persistent slowdown times the noise draw."""
        if not self.params.noise:
            return self.params.slowdown
        block = step // self.params.noise_block_steps
        if block != self._noise_block:
            sigma = self.params.noise
            z = stable_normal("noise", self.params.seed, self.instance_id, block)
            self._noise_block, self._noise_factor = block, math.exp(sigma * z - sigma * sigma / 2)
        return self.params.slowdown * self._noise_factor

    # ------------------------------------------------------------------ internals: scheduling

    def _reschedule(self) -> None:
        """After a command: start an idle instance, or re-plan a step that began at this instant."""
        if self._pull_end is not None or self._kept_pull is not None:
            return
        if self._step_end is None:
            self._clock = self.now
            self._begin_step()
        elif self._clock == self.now:
            self._begin_step(replan=True)

    def _can_admit_head(self, kv_tokens: int, n: int) -> bool:
        if not self._waiting or n >= self.params.max_running:
            return False
        head = self._live[self._waiting[0]]
        needed = kv_tokens + n + len(head.request.prompt_ids) + head.generated + 1
        return self.cost.kv_units(needed) <= self.cost.kv_budget

    def _admit(self) -> dict[str, int]:
        """Admit the waiting queue FIFO while the head fits; returns their contexts to prefill."""
        admitted = {}
        while self._can_admit_head(self._kv_tokens, len(self._running)):
            live = self._live[self._waiting.popleft()]
            context = len(live.request.prompt_ids) + live.generated
            live.running = True
            live.admitted_step = self._steps
            live.finish_step = self._steps + live.target - live.generated
            self._running[live.request.traj_id] = live
            self._kv_tokens += context
            self._tiebreak += 1
            heapq.heappush(self._completions, (live.finish_step, self._tiebreak, live.request.traj_id))
            # the upper bound's engine keeps every trajectory's KV: only its first admission prefills
            admitted[live.request.traj_id] = context if self.params.reprefill or not live.generated else 0
        return admitted

    def _preempt_to_fit(self) -> bool:
        """Preempt the newest running trajectories until every one has room for its next token."""
        preempted = []
        while self._running and self.cost.kv_units(self._kv_tokens + len(self._running)) > self.cost.kv_budget:
            _, live = self._running.popitem()
            self._release(live)
            preempted.append(live.request.traj_id)
        # the earliest admitted of them goes first, ahead of everything that waited already
        self._waiting.extendleft(preempted)
        self.stats.preemptions += len(preempted)
        return bool(preempted)

    def _release(self, live: _Live) -> None:
        """Drop a running trajectory's KV (its tokens so far are kept)."""
        live.generated = self._generated_now(live)
        live.running = False
        self._kv_tokens -= len(live.request.prompt_ids) + live.generated

    def _take(self, traj_ids: Iterable[str]) -> tuple[list[_Live], list[str]]:
        """Remove these trajectories from the instance; returns them and the unknown ids."""
        taken, not_found = [], []
        for traj_id in dict.fromkeys(traj_ids):
            live = self._live.get(traj_id)
            if live is None:
                not_found.append(traj_id)
            else:
                self._remove(live)
                taken.append(live)
        if taken:
            self._reschedule()
        return taken, not_found

    def _remove(self, live: _Live) -> None:
        traj_id = live.request.traj_id
        if live.running:
            del self._running[traj_id]
            self._release(live)
        else:
            self._waiting.remove(traj_id)
        del self._live[traj_id]

    def _generated_now(self, live: _Live) -> int:
        if live.running:
            return live.generated + self._steps - live.admitted_step
        return live.generated

    def _min_remaining(self) -> int:
        heap = self._completions
        while heap:
            finish_step, _, traj_id = heap[0]
            live = self._running.get(traj_id)
            if live is not None and live.finish_step == finish_step:
                return finish_step - self._steps
            heapq.heappop(heap)
        raise RuntimeError("no running trajectory")  # callers check n > 0

    def _target(self, request: TrajectoryRequest) -> tuple[int, FinishReason]:
        max_tokens = request.sampling.max_tokens
        if request.sampling.ignore_eos:
            return max_tokens, FinishReason.LENGTH
        length, finish = self.params.workload.target_length(request.group_id, request.traj_id, max_tokens)
        # a resumed trajectory that is already past its natural length stops at the next token
        length = max(length, request.num_generated + 1)
        return length, FinishReason.LENGTH if length >= max_tokens else FinishReason(finish)

    def _partial(self, live: _Live) -> PartialTrajectory:
        return PartialTrajectory(**_grow(live.request, live.generated, live.marks, self.params.workload))

    def _finish(self, live: _Live, reason: FinishReason) -> None:
        at = self.now if reason is FinishReason.ABORT else self._clock
        self._finished.append(SimFinished(live.request, live.generated, tuple(live.marks), reason, at,
                                          self.params.workload))



class SimEngine(RolloutEngine):
    """A ``SimCore`` behind the async engine interface.

    ``clock="virtual"``: time moves only through ``advance_to`` / ``advance_by`` (deterministic).
    ``clock="real"``: a background task keeps the core at ``elapsed_wall_seconds * speed`` and wakes
    up when the next trajectory is due to complete, so completions stream out on time.
    """

    def __init__(
        self,
        params: SimParams | None = None,
        *,
        instance_id: str = "sim",
        clock: Clock | str = Clock.VIRTUAL,
        speed: float = 1.0,
        pull_weights: bool = False,
    ):
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.core = SimCore(params, instance_id)
        self.clock = Clock(clock)
        self.speed = speed
        self.pull_weights = pull_weights
        self._stream = CompletionStream()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started_at: float | None = None
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started_at is not None:
            return
        self._started_at = time.monotonic()
        if self.clock is Clock.REAL:
            self._task = asyncio.create_task(self._run_real_time(), name=f"sim-{self.core.instance_id}")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._stream.close()

    # ------------------------------------------------------------------ commands

    async def route(self, requests: Sequence[TrajectoryRequest]) -> None:
        self._sync()
        self.core.route(requests)
        self._changed()

    async def interrupt(self, traj_ids: Iterable[str]) -> InterruptResult:
        self._sync()
        result = self.core.interrupt(traj_ids)
        self._changed()
        return result

    async def abort(self, traj_ids: Iterable[str]) -> AbortResult:
        self._sync()
        result = self.core.abort(traj_ids)
        self._changed()
        return result

    async def load_weights(self, weights: WeightsRef, keep_running: bool = False) -> list[PartialTrajectory]:
        if isinstance(weights, WeightsFromParams):  # simulated: the transfer of the configured model size
            if self.pull_weights:  # and the version's bytes for real, from where the Pull says
                await asyncio.to_thread(pull_version_bytes, weights)
            weights = SimWeights(weights.version)
        if not isinstance(weights, SimWeights):
            raise EngineError("invalid_weights", f"the sim engine takes SimWeights, got {type(weights).__name__}")
        self._sync()
        partials = self.core.load_weights(weights.version, weights.size_bytes, keep_running)
        self._changed()
        return partials

    async def snapshot(self) -> EngineSnapshot:
        self._sync()
        return self.core.snapshot()

    def completions(self) -> AsyncIterator[CompletedTrajectory]:
        return aiter(self._stream)

    async def progress(self, reported: Mapping[str, int], min_new: int = 1) -> list[Progress]:
        self._sync()
        return self.core.progress(reported, min_new)

    async def stats(self) -> dict[str, Any]:
        """The core's accounting on the simulated clock: decode, prefill (re-prefill included:
        the simulator prices every admitted context token alike), Pull, and idle, the rest."""
        self._sync()
        stats = self.core.stats
        parts = {"decode": stats.decode_seconds, "prefill": stats.prefill_seconds, "pull": stats.pull_seconds}
        rollout = max(self.core.now, sum(parts.values()))  # a Pull is booked whole when it starts
        parts["idle"] = rollout - sum(parts.values())
        return {"available": True, "source": "simulated", "method": "sim cost model on the simulated clock",
                "rollout_seconds": rollout, "breakdown_seconds": parts, "idle_seconds": parts["idle"],
                **dataclasses.asdict(stats)}

    async def drained(self) -> None:
        """Wait until the ``completions()`` consumer has handled everything finished so far."""
        await self._stream.drained()

    # ------------------------------------------------------------------ virtual clock

    @property
    def now(self) -> float:
        return self.core.now

    async def advance_to(self, t: float) -> None:
        if self.clock is not Clock.VIRTUAL:
            raise EngineError("wrong_clock", "advance_to needs the virtual clock; this engine runs on real time")
        self.core.advance_to(t)
        self._deliver()

    async def advance_by(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        await self.advance_to(self.core.now + seconds)

    async def run_until_idle(self, limit: float = math.inf) -> float:
        """Advance event by event until nothing is in flight (or ``limit``); returns the time."""
        while (t := self.core.next_event_time()) is not None and t <= limit:
            await self.advance_to(t)
        return self.core.now

    # ------------------------------------------------------------------ internals

    def _sync(self) -> None:
        if self.clock is Clock.REAL and self._started_at is not None:
            self.core.advance_to(max(self.core.now, (time.monotonic() - self._started_at) * self.speed))
        self._deliver()

    def _deliver(self) -> None:
        for finished in self.core.pop_finished():
            self._stream.put(finished.trajectory())

    def _changed(self) -> None:
        self._deliver()
        self._wake.set()

    async def _run_real_time(self) -> None:
        while True:
            self._sync()
            due = self.core.next_event_time()
            timeout = None if due is None else max(0.0, (due - self.core.now) / self.speed)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass


__all__ = ["SimCore", "SimEngine", "SimFinished", "SimStats"]
