"""Profiling a rollout engine for calibration: the engine-facing, async half.

``profile(probe, config)`` measures, through the ``RolloutEngine`` interface plus a small
engine-specific ``Probe`` (clock, token counts, KV capacity):

* **decode-step latency** over a grid of running counts ``n`` x context lengths: route ``n``
  trajectories with distinct prompts of the context length (``ignore_eos``), wait until all of them
  decode, then read the clock, the tokens generated so far and the snapshot's KV at a few interval
  boundaries. Per interval the mean step latency is ``elapsed * n / tokens generated``, at the mean
  KV of its two ends (exact for Eq. 11, which is linear in KV while the KV grows linearly);
* **KV footprint per token** (``k5``): snapshot KV against the tokens the running trajectories hold;
* **KV budget** ``M``: the engine's admission limit in tokens (sim: the largest trajectory it accepts,
  by bisection on its ``exceeds_kv_budget`` refusal; vLLM: KV blocks x block size);
* **prefill cost per token**: time to the first token of single trajectories of several lengths;
* **weight-load time**: a Pull of the same model (sim: ``SimWeights``; vLLM: the model directory).

The simulator runs on its virtual clock (a full grid takes well under a second of wall time); vLLM
is measured in wall time. ``entry_from_profile`` turns the measurements into a calibration entry
with the pure fits of ``staleflow.calibration.fit``.
"""

from __future__ import annotations

import abc
import asyncio
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from staleflow.calibration import (
    CalibrationEntry,
    DecodeReport,
    DecodeSample,
    ProfileGridInfo,
    Thresholds,
    build_entry,
    fit_decode,
    fit_kv_footprint,
    fit_prefill,
)
from staleflow.calibration.cpu import CpuMeter
from staleflow.config.calibration import ProfileConfig
from staleflow.config.engines import Clock, SimParams
from staleflow.engines.base import (
    EngineError,
    RolloutEngine,
    SamplingParams,
    SimWeights,
    TrajectoryRequest,
    WeightsPath,
    WeightsRef,
)
from staleflow.engines.sim import SimEngine

ProgressFn = Callable[[int, int, str], None]  # (completed, total, what is being measured)


@dataclass
class ProfileData:
    """Raw measurements of one profiling run."""

    samples: list[DecodeSample] = field(default_factory=list)
    kv_pairs: list[tuple[float, float]] = field(default_factory=list)  # (tokens held, snapshot kv)
    kv_budget: float = 0.0
    kv_budget_in_kv_units: bool = False  # else in tokens: M = k5 x kv_budget
    prefill: list[tuple[float, float]] = field(default_factory=list)  # (prompt tokens, time to first token)
    weight_loads: list[float] = field(default_factory=list)
    points: list[tuple[int, int]] = field(default_factory=list)  # measured (n, context)
    notes: list[str] = field(default_factory=list)
    kv_bytes_per_token: float | None = None
    wall_seconds: float = 0.0
    intervals: int = 0
    disturbed: int = 0  # intervals dropped because other processes competed for the CPU
    foreign_load: list[float] = field(default_factory=list)  # cores other processes used, per interval
    waited: list[float] = field(default_factory=list)  # run-queue wait subtracted, fraction of each interval


EngineT = TypeVar("EngineT", bound=RolloutEngine)


class Probe(abc.ABC, Generic[EngineT]):
    """What profiling needs beyond ``RolloutEngine``: a clock, token counts, the KV capacity."""

    engine: EngineT
    realtime: bool
    vocab_size: int
    engine_name: str = "rollout"
    max_context: int | None = None  # prompt + response tokens one trajectory may hold
    max_running: int | None = None
    distinct_prompts: bool = True  # defeat prefix caching, which would shrink the KV
    kv_bytes_per_token: float | None = None
    meter: CpuMeter | None = None  # real time: watches other processes competing for the CPU

    @abc.abstractmethod
    async def now(self) -> float: ...

    @abc.abstractmethod
    async def wait(self, seconds: float) -> None:
        """Let ``seconds`` of engine time pass."""

    _counter: Any  # has ``generated(traj_id)``, raising KeyError for trajectories not on the engine

    def generated(self, traj_id: str) -> int | None:
        """Response tokens the trajectory holds now; None once it left the engine."""
        try:
            return self._counter.generated(traj_id)
        except KeyError:
            return None

    @abc.abstractmethod
    async def kv_budget(self) -> tuple[float, bool]:
        """The KV budget and whether it is in the snapshot's KV units (True) or in tokens (False)."""

    @abc.abstractmethod
    async def discard(self, traj_ids: Sequence[str]) -> None:
        """Remove these trajectories (whatever state they are in)."""

    @abc.abstractmethod
    async def until_finished(self, traj_ids: Sequence[str]) -> float:
        """Wait until these trajectories finished; returns the clock at the last completion."""

    @abc.abstractmethod
    def weights(self, version: int) -> WeightsRef: ...

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.stop()

    async def settle(self) -> None:  # an optional hook: most probes have nothing in flight
        """Let work in flight (a step, a Pull) end when nothing is running any more."""

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Let time pass until ``predicate`` holds (False after ``timeout`` engine seconds)."""
        start = await self.now()
        step = self._first_poll
        while not predicate():
            if await self.now() - start > timeout:
                return False
            await self.wait(step)
            step = min(step * 2, self._max_poll)
        return True

    _first_poll = 0.002
    _max_poll = 0.002


class SimProbe(Probe[SimEngine]):
    """A ``SimEngine`` on its virtual clock: profiling costs events, not simulated seconds."""

    realtime = False
    engine_name = "sim"
    distinct_prompts = False  # no prefix cache to defeat; one shared prompt tuple saves memory
    _first_poll = 1e-4
    _max_poll = 1.0

    def __init__(self, engine: SimEngine):
        if engine.clock is not Clock.VIRTUAL:
            raise ValueError("profile a sim engine on its virtual clock (clock='virtual')")
        self.engine = engine
        self.core = self._counter = engine.core
        self.vocab_size = self.core.params.workload.vocab_size
        self.max_running = self.core.params.max_running

    @classmethod
    def create(cls, params: SimParams, instance_id: str = "calibrate") -> SimProbe:
        return cls(SimEngine(params, instance_id=instance_id, clock=Clock.VIRTUAL))

    async def now(self) -> float:
        return self.engine.now

    async def wait(self, seconds: float) -> None:
        self.core.advance_to(self.core.now + seconds)
        self.core.pop_finished()  # nobody consumes completions here; skip building them

    async def kv_budget(self) -> tuple[float, bool]:
        """In tokens: the largest prompt + max_tokens the instance accepts (it refuses what can never fit)."""

        async def accepted(total: int) -> bool:
            request = _request("cal-budget", (1,), total - 1)
            try:
                await self.engine.route([request])
            except EngineError as exc:
                if exc.code == "exceeds_kv_budget":
                    return False
                raise
            await self.discard([request.traj_id])
            return True

        lo, hi = 2, 4
        while await accepted(hi):
            lo, hi = hi, hi * 2
            if hi > 2**50:
                raise RuntimeError("the sim engine accepts trajectories of any length: no KV budget found")
        while hi - lo > 1:  # accepted(lo), refused(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if await accepted(mid) else (lo, mid)
        return float(lo), False

    async def discard(self, traj_ids: Sequence[str]) -> None:
        self.core.abort(traj_ids)
        self.core.pop_finished()
        await self.settle()  # so the next measurement does not wait out an emptied step

    async def settle(self) -> None:
        while not self.core.snapshot().run_trajs and (t := self.core.next_event_time()) is not None:
            self.core.advance_to(t)
        self.core.pop_finished()

    async def until_finished(self, traj_ids: Sequence[str]) -> float:
        pending = set(traj_ids)
        while pending and (t := self.core.next_event_time()) is not None:
            self.core.advance_to(t)
            pending -= {f.traj_id for f in self.core.pop_finished()}
        if pending:
            raise RuntimeError(f"the sim engine went idle with {sorted(pending)} unfinished")
        return self.core.now

    def weights(self, version: int) -> SimWeights:
        return SimWeights(version)


class VllmProbe(Probe[Any]):  # a VllmEngine, imported only where vLLM is
    """A ``VllmEngine``, measured in wall time."""

    realtime = True
    engine_name = "vllm"
    _first_poll = 0.002
    _max_poll = 0.005

    def __init__(self, engine: Any, model_dir: str | Path):
        self.engine = self._counter = engine
        self.model_dir = str(model_dir)
        self.max_context = engine.params.max_model_len
        config = read_model_config(self.model_dir)
        self.vocab_size = int(config.get("vocab_size", 0))
        self.kv_bytes_per_token = kv_bytes_per_token_of(config, engine.params.dtype)
        self.meter = CpuMeter.create()
        self._finished: dict[str, float] = {}
        self._arrived = asyncio.Event()
        self._consumer: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, params: Any) -> VllmProbe:
        from staleflow.engines.vllm_engine import VllmEngine

        return cls(VllmEngine(params), params.model)

    async def start(self) -> None:
        await self.engine.start()
        # VllmEngine exposes no capacity accessor: read vLLM's own config of the running engine
        config = self.engine._llm.vllm_config
        self.max_running = int(config.scheduler_config.max_num_seqs)
        self._cache = config.cache_config
        self.vocab_size = int(self.engine._llm.model_config.get_vocab_size())
        self._consumer = asyncio.create_task(self._consume(), name="calibrate-completions")

    async def close(self) -> None:
        await self.engine.stop()
        if self._consumer is not None:
            await asyncio.wait_for(self._consumer, 30)

    async def _consume(self) -> None:
        async for done in self.engine.completions():
            self._finished[done.traj_id] = time.monotonic()
            self._arrived.set()

    async def now(self) -> float:
        return time.monotonic()

    async def wait(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def kv_budget(self) -> tuple[float, bool]:
        """In KV units: the snapshot's ``kv_cache`` is usage x blocks x block size, full at blocks x block size."""
        return float((self._cache.num_gpu_blocks or 0) * self._cache.block_size), True

    async def discard(self, traj_ids: Sequence[str]) -> None:
        await self.engine.abort(traj_ids)

    async def until_finished(self, traj_ids: Sequence[str]) -> float:
        deadline = time.monotonic() + 600
        while not all(t in self._finished for t in traj_ids):
            self._arrived.clear()
            await asyncio.wait_for(self._arrived.wait(), max(0.001, deadline - time.monotonic()))
        return max(self._finished[t] for t in traj_ids)

    def weights(self, version: int) -> WeightsPath:
        return WeightsPath(version, self.model_dir)


def read_model_config(model_dir: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token_of(config: dict[str, Any], dtype: str) -> float | None:
    """2 (K and V) x layers x KV heads x head dim x bytes per element, from a HF config."""
    try:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        return float(2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype])
    except (KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------- measuring


def _request(traj_id: str, prompt: tuple[int, ...], max_tokens: int) -> TrajectoryRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return TrajectoryRequest(traj_id=traj_id, group_id="calibrate", prompt_ids=prompt, v_traj=0, sampling=sampling)


class _Prompts:
    """Prompts of a given length: distinct random ones (no prefix sharing) or one shared tuple."""

    def __init__(self, probe: Probe, seed: int):
        self.vocab = max(probe.vocab_size, 8)
        self.distinct = probe.distinct_prompts
        self.rng = np.random.default_rng(seed)

    def make(self, length: int, count: int) -> list[tuple[int, ...]]:
        if not self.distinct:
            return [tuple(range(1, length + 1))] * count  # the sim ignores token values
        ids = self.rng.integers(4, self.vocab, size=(count, length))
        return [tuple(row) for row in ids.tolist()]


def plan_points(config: ProfileConfig, budget_tokens: float, max_context: int | None,
                max_running: int | None) -> tuple[list[tuple[int, int, int]], list[str]]:
    """(n, context, max_tokens) of each decode point that fits, and notes on what was left out."""
    plan, notes = [], []
    for n in config.n_values:
        if max_running is not None and n > max_running:
            notes.append(f"n = {n} skipped: the engine runs at most {max_running} trajectories")
            continue
        used: set[int] = set()
        room = int(config.kv_fill * budget_tokens / n)  # tokens per trajectory the budget allows
        if max_context is not None:
            room = min(room, max_context)
        for context in config.contexts:
            # ask for decode_tokens when they fit; else halve the room between prompt and response
            context = min(context, room // 2) if context + config.decode_tokens > room else context
            max_tokens = min(config.decode_tokens, room - context) if max_context is None else room - context
            if context < 16 or max_tokens < 64 or context in used:
                continue
            used.add(context)
            plan.append((n, context, max_tokens))
        if not used:
            notes.append(f"n = {n} skipped: {n} trajectories do not fit {config.kv_fill:.0%} of the KV budget")
    return plan, notes


@dataclass
class _Boundary:
    time: float
    tokens: int
    kv: float
    running: int
    held: float  # tokens held by the running trajectories
    foreign: float | None  # CPU seconds used by other processes so far (None: not metered)
    waited: float | None = None  # seconds the engine's stepping thread was runnable but not running so far


async def _boundary(probe: Probe, ids: Sequence[str], context: int) -> _Boundary | None:
    t = await probe.now()
    counts = [probe.generated(i) for i in ids]
    snap = await probe.engine.snapshot()
    if any(c is None for c in counts):
        return None
    tokens = sum(counts)  # type: ignore[arg-type]
    return _Boundary(t, tokens, float(snap.kv_cache), len(snap.run_trajs) if not snap.wait_trajs else -1,
                     len(ids) * context + tokens, probe.meter.foreign_seconds() if probe.meter else None,
                     probe.meter.engine_wait_seconds() if probe.meter else None)


@dataclass
class ProbePoint:
    """What one grid point yielded."""

    samples: list[DecodeSample] = field(default_factory=list)
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (tokens held, snapshot kv)
    disturbed: list[DecodeSample] = field(default_factory=list)  # intervals other processes competed in
    foreign: list[float] = field(default_factory=list)  # cores other processes used, per interval
    waited: list[float] = field(default_factory=list)  # fraction of each interval the engine waited for a CPU
    note: str | None = None

    def merge(self, other: ProbePoint) -> None:
        self.samples += other.samples
        self.pairs += other.pairs
        self.disturbed += other.disturbed
        self.foreign += other.foreign
        self.waited += other.waited
        self.note = self.note or other.note


async def measure_decode_point(probe: Probe, config: ProfileConfig, prompts: _Prompts, point: int, n: int,
                               context: int, max_tokens: int, attempt: int = 0) -> ProbePoint:
    """Decode samples of one grid point (``note`` says why there are none)."""
    ids = [f"cal-p{point}-a{attempt}-{i}" for i in range(n)]
    where = f"n = {n}, context {context}"
    await probe.engine.route([_request(i, p, max_tokens) for i, p in zip(ids, prompts.make(context, n), strict=True)])
    try:
        def tokens_each(k: int) -> bool:
            return all((g := probe.generated(i)) is not None and g >= k for i in ids)

        if not await probe.wait_until(lambda: tokens_each(2), config.timeout_s):
            return ProbePoint(note=f"{where}: not all trajectories started decoding in time")
        first = await _boundary(probe, ids, context)
        if first is None or first.running != n:
            return ProbePoint(note=f"{where}: only {first and first.running} of {n} trajectories ran together")
        pilot_target = first.tokens + 4 * n

        def total() -> int:
            return sum(probe.generated(i) or 0 for i in ids)

        if not await probe.wait_until(lambda: total() >= pilot_target, config.timeout_s):
            return ProbePoint(note=f"{where}: decoding stalled")
        start = await _boundary(probe, ids, context)
        if start is None or start.tokens <= first.tokens:
            return ProbePoint(note=f"{where}: trajectories finished during warm-up")
        step = (start.time - first.time) * n / (start.tokens - first.tokens)
        left = max_tokens - start.tokens // n - 8  # steps still available to every trajectory
        dt = step * config.steps_per_sample
        if probe.realtime:
            dt = min(max(dt, config.min_sample_seconds), config.max_sample_seconds)
        dt = min(dt, 0.9 * step * left / config.samples_per_point)
        result = ProbePoint(pairs=[(start.held, start.kv)])
        previous = start
        for _ in range(config.samples_per_point):
            await probe.wait(dt)
            current = await _boundary(probe, ids, context)
            if current is None or current.running != n:
                break
            result.pairs.append((current.held, current.kv))
            generated = current.tokens - previous.tokens
            elapsed = current.time - previous.time
            waited = None if current.waited is None or previous.waited is None else current.waited - previous.waited
            if config.subtract_wait and waited is not None and 0 <= waited < elapsed:
                result.waited.append(waited / elapsed)
                timed = elapsed - waited
            else:
                timed = elapsed
            if generated > 0:
                sample = DecodeSample(n, (previous.kv + current.kv) / 2, timed * n / generated, point, generated / n)
                foreign = None
                if current.foreign is not None and previous.foreign is not None:
                    foreign = (current.foreign - previous.foreign) / elapsed
                busy = foreign is not None and config.max_foreign_load is not None and foreign > config.max_foreign_load
                if foreign is not None:
                    result.foreign.append(foreign)
                (result.disturbed if busy else result.samples).append(sample)
            previous = current
        if not result.samples and not result.disturbed:
            result.note = f"{where}: no complete interval"
        return result
    finally:
        await probe.discard(ids)


async def measure_prefill(probe: Probe, context: int, prompts: _Prompts, tag: str) -> float:
    """Seconds from routing one trajectory of ``context`` prompt tokens to its first token."""
    (prompt,) = prompts.make(context, 1)
    request = _request(f"cal-prefill-{tag}", prompt, 1)
    start = await probe.now()
    await probe.engine.route([request])
    return await probe.until_finished([request.traj_id]) - start


async def measure_weight_load(probe: Probe, version: int) -> float:
    """Seconds a Pull of ``version`` keeps the instance from generating."""
    start = await probe.now()
    await probe.engine.load_weights(probe.weights(version))
    await probe.settle()  # the sim's Pull ends on its clock; vLLM's when load_weights returns
    return await probe.now() - start


def machine_stays_busy(foreign_load: list[float], limit: float | None) -> bool:
    """Whether other processes kept using more than ``limit`` cores through most of the intervals so
    far (at least 10): retrying a disturbed point then waits for a quiet that does not come."""
    return limit is not None and len(foreign_load) >= 10 and statistics.median(foreign_load) > limit


async def _measure_point(probe: Probe, config: ProfileConfig, prompts: _Prompts, point: int, n: int, context: int,
                         max_tokens: int, run: int, retry: bool = True) -> ProbePoint:
    """One grid point: repeated where the KV budget shortens its responses below ``decode_tokens``,
    and retried (after a pause, if ``retry``) while other processes competing for the CPU spoil its
    intervals."""
    repeats = min(config.max_repeats, math.ceil(config.decode_tokens / max_tokens))
    wanted = max(2, config.samples_per_point // 2) if repeats == 1 else 1
    result = ProbePoint()
    for attempt in range(repeats + (config.retries if retry else 0)):
        if attempt >= repeats:
            if len(result.samples) >= wanted:
                break
            await probe.wait(config.retry_pause_s)  # let the other work pass
        result.merge(await measure_decode_point(probe, config, prompts, point, n, context, max_tokens,
                                                run * (config.max_repeats + config.retries) + attempt))
        if result.note:
            break
    return result


def trim_outliers(samples: list[DecodeSample], factor: float | None) -> list[DecodeSample]:
    """Drop intervals off their point's median latency by more than ``factor`` either way.

    Slow ones were disturbed by other work; fast ones took tokens that an earlier, slow interval
    generated but the consumer had not yet received.
    """
    if factor is None or len(samples) < 3:
        return samples
    median = statistics.median(s.latency for s in samples)
    return [s for s in samples if median / factor <= s.latency <= median * factor]


async def profile(probe: Probe, config: ProfileConfig, progress: ProgressFn | None = None) -> ProfileData:
    """Measure everything a calibration needs (the probe's engine must be started)."""
    wall = time.monotonic()
    data = ProfileData(kv_bytes_per_token=probe.kv_bytes_per_token)
    report = progress or (lambda done, total, what: None)
    report(0, 1, "KV budget")
    data.kv_budget, data.kv_budget_in_kv_units = await probe.kv_budget()
    # planning treats the budget as tokens: exact for the sim, about right for vLLM (k5 ~ 1)
    plan, data.notes = plan_points(config, data.kv_budget, probe.max_context, probe.max_running)
    limit = min(config.kv_fill * data.kv_budget, (probe.max_context or math.inf) - 2)
    prefill = [c for c in config.prefill_contexts if c <= limit]
    total = 1 + len(plan) * config.passes + len(prefill) * config.prefill_reps + config.weight_loads
    done = 1
    prompts = _Prompts(probe, config.seed)
    best: dict[int, tuple[float, list[DecodeSample]]] = {}  # point -> (median latency, samples) of its best pass
    spread: list[float] = []  # slowest / fastest pass median per point
    for p in range(config.passes):
        order = list(enumerate(plan)) if p % 2 == 0 else list(reversed(list(enumerate(plan))))
        for point, (n, context, max_tokens) in order:
            report(done, total, f"decode n={n} context={context}" + (f" (pass {p + 1})" if config.passes > 1 else ""))
            busy = machine_stays_busy(data.foreign_load, config.max_foreign_load)
            result = await _measure_point(probe, config, prompts, point, n, context, max_tokens, p, retry=not busy)
            data.kv_pairs += result.pairs
            data.intervals += len(result.samples) + len(result.disturbed)
            data.disturbed += len(result.disturbed)
            data.foreign_load += result.foreign
            data.waited += result.waited
            samples = trim_outliers(result.samples or result.disturbed, config.trim)  # disturbed: only if nothing else
            if result.note:
                data.notes.append(result.note)
            elif not result.samples:
                data.notes.append(f"n = {n}, context {context}: every interval had other processes competing for the "
                                  "CPU; kept them anyway")
            if samples:
                level = statistics.median(s.latency for s in samples)
                if point in best:
                    spread.append(max(level, best[point][0]) / min(level, best[point][0]))
                if point not in best or level < best[point][0]:
                    best[point] = (level, samples)
            done += 1
    for point in sorted(best):
        data.samples += best[point][1]
        data.points.append(plan[point][:2])
    if spread and (disagree := sum(r > 1.2 for r in spread)):
        data.notes.append(f"passes disagreed by more than 20% at {disagree} of {len(spread)} grid points "
                          f"(worst x{max(spread):.2f}): timings are disturbed; the faster pass was kept")
    if machine_stays_busy(data.foreign_load, config.max_foreign_load):
        data.notes.append("other processes kept the machine busy through most intervals: disturbed points were kept "
                          "without waiting for a quiet moment; calibrate on a quiet machine for the best fit")
    if data.disturbed:
        data.notes.append(f"{data.disturbed} of {data.intervals} intervals had other processes using more than "
                          f"{config.max_foreign_load} cores and were dropped (median over all intervals: "
                          f"{statistics.median(data.foreign_load):.2f} cores)")
    if data.waited:
        data.notes.append(f"timed without the engine thread's run-queue wait: {statistics.median(data.waited):.1%} of "
                          f"an interval (median; worst {max(data.waited):.1%}) was waiting for a CPU and is not counted")
    for rep in range(config.prefill_reps):
        for context in prefill:
            report(done, total, f"prefill {context} tokens")
            data.prefill.append((context, await measure_prefill(probe, context, prompts, f"{rep}-{context}")))
            done += 1
    version = (await probe.engine.snapshot()).inst_version
    for k in range(config.weight_loads):
        report(done, total, "weight load")
        data.weight_loads.append(await measure_weight_load(probe, version + 1 + k))
        done += 1
    report(total, total, "done")
    data.wall_seconds = time.monotonic() - wall
    return data


def entry_from_profile(
    data: ProfileData,
    config: ProfileConfig,
    *,
    model: str,
    parallelism: str,
    engine: str,
    thresholds: Thresholds = Thresholds(),
    folds: int = 4,
    bootstrap: int = 0,
    truth: dict[str, float] | None = None,
) -> tuple[CalibrationEntry, DecodeReport]:
    """Fit the measurements (``staleflow.calibration``) into a calibration entry."""
    report = fit_decode(data.samples, folds=folds, seed=config.seed, bootstrap=bootstrap)
    k5, kv_r2 = fit_kv_footprint(data.kv_pairs)
    prefill = fit_prefill(data.prefill, report.fit.k1, k5) if data.prefill else None
    entry = build_entry(
        model=model, parallelism=parallelism, engine=engine, report=report, k5=k5, kv_r2=kv_r2,
        kv_budget=data.kv_budget if data.kv_budget_in_kv_units else k5 * data.kv_budget,
        thresholds=thresholds, prefill_seconds_per_token=prefill,
        weight_load_seconds=statistics.median(data.weight_loads) if data.weight_loads else None,
        kv_bytes_per_token=data.kv_bytes_per_token, kv_unit="kv-unit" if engine == "sim" else "token",
        grid=ProfileGridInfo(n_values=sorted({n for n, _ in data.points}),
                             contexts=sorted({c for _, c in data.points}), samples_per_point=config.samples_per_point),
        extra_warnings=data.notes, wall_seconds=data.wall_seconds, truth=truth,
    )
    return entry, report
