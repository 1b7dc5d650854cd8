"""The instance server's service: the completed-trajectory outbox and ``InstanceServer``, which
applies commands to the engine one at a time, records them for idempotent replay and feeds the
outbox."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from staleflow.api.base import TRANSIENT_STATUS, ServiceError
from staleflow.api.instance import (
    AbortApplied,
    AbortCommand,
    AdvanceIn,
    AnyCommand,
    InterruptApplied,
    InterruptCommand,
    PullApplied,
    PullCommand,
    RouteApplied,
    RouteCommand,
)
from staleflow.api.trajectories import AsyncTrajectoryClient, TrajectoryRoutes
from staleflow.api.trajectory import Completion, WireTrajectory
from staleflow.config import InstanceConfig
from staleflow.config.engines import Clock
from staleflow.engines.base import (
    CompletedTrajectory,
    EngineError,
    EngineSnapshot,
    PartialTrajectory,
    RolloutEngine,
)
from staleflow.engines.factory import create_engine
from staleflow.engines.sim import SimEngine
from staleflow.errors import ErrorCode
from staleflow.servers.instance.wire import (
    carried_by_instance,
    engine_request,
    finished_trajectory,
    progress_part,
    weights_ref,
    wire_trajectory,
)

log = logging.getLogger(__name__)

CALLBACK_BACKOFF_S = 0.1  # first retry of a failed delivery; doubled up to CALLBACK_MAX_BACKOFF_S
CALLBACK_MAX_BACKOFF_S = 5.0
CALLBACK_ERROR_ATTEMPTS = 5  # a server error other than 502/503/504 this many times in a row: the batch is dropped
PROGRESS_POLL_S = 0.2  # how often the engine is asked whether a trajectory is due for a checkpoint
HELD_EVERY_S = 1.0  # between checkpoints, how often the trajectory server hears how far trajectories got


@dataclass
class _Recorded:
    fingerprint: str
    status: int
    body: bytes  # the response, as compact JSON: a partial's tokens take a few bytes each, not objects


class ReplayWindow:
    """The responses of the last commands, by ``command_id``, for a retry to get the same answer.
    Bounded by count and by bytes: a Pull or an Interrupt answers with partials (every token and
    log-prob of each), so a count alone would let the window hold gigabytes on a long run."""

    def __init__(self, max_commands: int, max_bytes: int):
        self.max_commands = max_commands
        self.max_bytes = max_bytes
        self.bytes = 0
        self._recorded: OrderedDict[str, _Recorded] = OrderedDict()

    def get(self, command_id: str) -> _Recorded | None:
        return self._recorded.get(command_id)

    def record(self, command_id: str, fingerprint: str, status: int, body: dict[str, Any]) -> None:
        recorded = _Recorded(fingerprint, status, json.dumps(body, separators=(",", ":")).encode())
        self._recorded[command_id] = recorded
        self.bytes += len(recorded.body)
        # the newest is kept even when it alone exceeds the byte bound: its retry is the likely one
        while len(self._recorded) > 1 and (len(self._recorded) > self.max_commands or self.bytes > self.max_bytes):
            _, dropped = self._recorded.popitem(last=False)
            self.bytes -= len(dropped.body)

    def __len__(self) -> int:
        return len(self._recorded)


class Outbox:
    """Completed trajectories numbered 1, 2, ...; each is kept until a consumer that was handed it
    acknowledges it by its ``seq``. Reading never removes anything: an acknowledged item leaves
    memory, and beyond ``limit`` unacknowledged items the oldest is dropped (counted)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.next_seq = 1
        self.acked = 0  # items acknowledged so far
        self.dropped = 0
        self._items: dict[int, Completion] = {}  # by seq, in seq order
        self._delivered: set[int] = set()  # seqs handed to a consumer at least once
        self._arrived = asyncio.Event()

    def add(self, instance_id: str, trajectory: CompletedTrajectory, carried: Mapping[str, Any] | None = None) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self._items[seq] = Completion(seq=seq, instance_id=instance_id, finished_at=time.time(),
                                      trajectory=finished_trajectory(trajectory, carried))
        if len(self._items) > self.limit:
            lost = next(iter(self._items))
            self._forget(lost)
            self.dropped += 1
            log.warning("outbox over its limit of %d: dropped completed trajectory seq %d unacknowledged", self.limit, lost)
        self._arrived.set()

    def _forget(self, seq: int) -> None:
        del self._items[seq]
        self._delivered.discard(seq)

    def handed_out(self, items: list[Completion]) -> None:
        """These items reached a consumer: from now on they may be acknowledged."""
        self._delivered.update(item.seq for item in items if item.seq in self._items)

    def ack(self, seqs: Iterable[int]) -> tuple[list[int], list[int]]:
        """Acknowledge items that were handed out; returns (acknowledged, ignored): an unknown,
        already acknowledged or never delivered seq is ignored."""
        acknowledged, ignored = [], []
        for seq in dict.fromkeys(seqs):
            if seq in self._delivered:
                self._forget(seq)
                acknowledged.append(seq)
            else:
                ignored.append(seq)
        self.acked += len(acknowledged)
        return acknowledged, ignored

    def after(self, seq: int, limit: int) -> list[Completion]:
        out = []
        for item_seq, item in self._items.items():
            if item_seq > seq:
                out.append(item)
                if len(out) >= limit:
                    break
        return out

    def has_after(self, seq: int) -> bool:
        return bool(self._items) and next(reversed(self._items)) > seq

    async def wait_after(self, seq: int, timeout: float) -> None:
        """Until an item newer than ``seq`` is held, or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while not self.has_after(seq):
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    @property
    def oldest_seq(self) -> int | None:
        return next(iter(self._items), None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ProgressTally:
    """Progress checkpoints sent by this instance: the response position of each trajectory's
    last checkpoint, and counters."""

    reported: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    checkpoints: int = 0
    tokens: int = 0
    seconds: float = 0.0
    last_round: float | None = None  # time.monotonic() of the last look at the engine

    def record(self, checkpoints: int, tokens: int, seconds: float) -> None:
        self.batches += 1
        self.checkpoints += checkpoints
        self.tokens += tokens
        self.seconds += seconds

    def counters(self) -> dict[str, Any]:
        since = None if self.last_round is None else time.monotonic() - self.last_round
        return {"batches": self.batches, "checkpoints": self.checkpoints, "tokens": self.tokens,
                "seconds": self.seconds, "since_last_round_s": since}


class InstanceServer:
    """The state behind the HTTP API of one instance."""

    def __init__(self, config: InstanceConfig, engine: RolloutEngine | None = None):
        self.config = config
        self.instance_id = config.instance_id
        self.engine = engine or create_engine(config)
        self.seq = 0
        self.commands_applied: dict[str, int] = {}  # by kind
        self.outbox = Outbox(config.outbox_limit)
        self.callback_delivered = 0
        self.boot_id = uuid.uuid4().hex  # a restarted instance is a new one: the coordinator tells them apart
        self._lock = asyncio.Lock()
        self._pulling = False
        self._replay = ReplayWindow(config.idempotency_window, config.idempotency_bytes)
        self._tasks: list[asyncio.Task[None]] = []
        self.progress = ProgressTally()
        self._carried: dict[str, dict[str, Any]] = {}  # traj_id -> its fields the engine does not know

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.engine.start()
        self._tasks.append(asyncio.create_task(self._collect_completions(), name="completions"))
        if self.config.completion_callback_url:
            self._tasks.append(asyncio.create_task(self._push_completions(), name="callback"))
        if self.config.progress_url and self.config.progress_tokens > 0:
            self._tasks.append(asyncio.create_task(self._checkpoint_progress(), name="progress"))

    async def stop(self) -> None:
        await self.engine.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _collect_completions(self) -> None:
        async for trajectory in self.engine.completions():
            self.outbox.add(self.instance_id, trajectory, self._carried.pop(trajectory.traj_id, None))

    async def _push_completions(self) -> None:
        """Deliver the outbox to the callback in order. A batch is acknowledged (and leaves the
        outbox) once the receiver took it, or refused it for good (a 4xx, or a server error that
        persists for ``CALLBACK_ERROR_ATTEMPTS`` tries): a refused batch is dropped and logged,
        and the coordinator's reconciliation hands its trajectories back for another try. The
        receiver being unreachable or restarting (network errors, 502/503/504) is retried until
        it answers, with capped, jittered backoff."""
        url = self.config.completion_callback_url
        assert url is not None
        async with AsyncTrajectoryClient("", timeout=30.0) as ts:  # called at the absolute URL; carries the token
            while True:
                await self.outbox.wait_after(self.callback_delivered, 3600.0)
                batch = self.outbox.after(self.callback_delivered, self.config.callback_batch)
                if batch:
                    await self._deliver(ts, url, batch)

    async def _deliver(self, ts: AsyncTrajectoryClient, url: str, batch: list[Completion]) -> None:
        first, last = batch[0].seq, batch[-1].seq
        backoff, errors = CALLBACK_BACKOFF_S, 0
        while True:
            try:
                await ts.call_at(url, TrajectoryRoutes.completed, instance_id=self.instance_id, items=batch)
            except httpx.HTTPError as exc:
                problem = f"failed ({exc.__class__.__name__}: {exc})"
            except ServiceError as exc:
                status = exc.status
                if status < 500 or (status not in TRANSIENT_STATUS and errors + 1 >= CALLBACK_ERROR_ATTEMPTS):
                    log.error("completion callback %s refused seq %d-%d with %d (%s): dropped; the coordinator "
                              "hands these trajectories back", url, first, last, status, exc.detail[:500])
                    break
                errors += status not in TRANSIENT_STATUS
                problem = f"answered {status}"
            except ValueError as exc:  # a 2xx whose body is not the trajectory server's answer: it took the batch
                log.warning("completion callback %s took seq %d-%d but its answer is not an Accepted: %s",
                            url, first, last, str(exc)[:500])
                break
            else:
                break
            log.warning("completion callback %s %s; retrying seq %d-%d in %.1fs", url, problem, first, last, backoff)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))  # retry pacing, not synchronisation
            backoff = min(backoff * 2, CALLBACK_MAX_BACKOFF_S)
        self.callback_delivered = last
        self.outbox.handed_out(batch)
        self.outbox.ack(item.seq for item in batch)

    # ------------------------------------------------------------------ progress checkpoints

    async def _checkpoint_progress(self) -> None:
        """Every ``PROGRESS_POLL_S``, send the trajectory server what each running trajectory
        generated since its last checkpoint, once that is ``progress_tokens`` tokens, and whatever
        it is every ``progress_seconds``: one batch per round. A batch also says how far every
        trajectory that grew got (lengths only), and so does a round with nothing due every
        ``HELD_EVERY_S``: a failure's regenerated tokens are counted to within a round or a second."""
        url = self.config.progress_url
        assert url is not None
        last_sweep = last_word = time.monotonic()
        async with AsyncTrajectoryClient("", timeout=30.0) as ts:  # called at the absolute URL
            while True:
                await asyncio.sleep(PROGRESS_POLL_S)  # the polling period, not synchronisation
                now = time.monotonic()
                sweep = now - last_sweep >= self.config.progress_seconds
                try:
                    said = await self.checkpoint(ts, url, 1 if sweep else self.config.progress_tokens,
                                                 say_held=now - last_word >= HELD_EVERY_S)
                    if said is None:
                        log.info("engine %s does not expose its progress: no checkpoints", self.config.engine)
                        return
                    if said or now - last_word >= HELD_EVERY_S:
                        last_word = now
                except (httpx.HTTPError, ValueError) as exc:  # the trajectory server restarting: the next round resends
                    log.debug("progress checkpoint to %s failed: %s", url, exc)
                if sweep:
                    last_sweep = time.monotonic()

    async def checkpoint(self, ts: AsyncTrajectoryClient, url: str, min_new: int, say_held: bool = False) -> int | None:
        """Send one checkpoint batch: the trajectories with at least ``min_new`` tokens beyond their
        last checkpoint, with how far every trajectory that grew got (``held``; with nothing due,
        sent only if ``say_held``). Returns how many checkpoints went (None: the engine does not
        expose progress)."""
        started = time.perf_counter()
        async with self._lock:
            held = await self.engine.snapshot()
            grown = await self.engine.progress(self.progress.reported, 1)
        if grown is None:
            return None
        items = [p for p in grown if len(p.tokens) >= min_new]
        self.progress.last_round = time.monotonic()
        on_engine = {*held.run_trajs, *held.wait_trajs, *(p.traj_id for p in grown)}
        for traj_id in [t for t in self.progress.reported if t not in on_engine]:
            del self.progress.reported[traj_id]
        if items or (say_held and grown):
            # "held": what an instance failure would make each trajectory generate again beyond its checkpoint
            try:
                reply = await ts.call_at(url, TrajectoryRoutes.progress, instance_id=self.instance_id,
                                         trajectories=[progress_part(p, self._carried.get(p.traj_id)) for p in items],
                                         held={p.traj_id: p.end for p in grown})
            except ServiceError as exc:
                log.warning("progress checkpoint refused by %s with %d: %s", url, exc.status, exc.detail[:500])
            else:
                stored = reply.stored
                for p in items:
                    # what the trajectory server holds now; a trajectory it does not route here is not resent
                    self.progress.reported[p.traj_id] = int(stored.get(p.traj_id, p.end))
                if items:
                    self.progress.record(len(items), sum(len(p.tokens) for p in items), time.perf_counter() - started)
        return len(items)

    async def held_progress(self) -> dict[str, Any]:
        """What each trajectory on the engine holds and what its last checkpoint holds."""
        async with self._lock:
            items = await self.engine.progress({}, 1)
        return {"instance_id": self.instance_id, "available": items is not None,
                "held": {p.traj_id: p.end for p in items or ()}, "checkpointed": dict(self.progress.reported),
                **self.progress.counters()}

    # ------------------------------------------------------------------ commands

    async def apply(self, command: AnyCommand) -> tuple[int, dict[str, Any], bool]:
        """Apply (or replay) a command; returns (status, body, replayed). A refusal is recorded
        (and replayed) like a result; reusing a ``command_id`` for another command raises."""
        fingerprint = hashlib.sha256(command.model_dump_json().encode()).hexdigest()
        async with self._lock:
            recorded = self._replay.get(command.command_id)
            if recorded is not None:
                if recorded.fingerprint != fingerprint:
                    raise EngineError(ErrorCode.COMMAND_ID_REUSED,
                                      f"command_id {command.command_id} was already used for a different command")
                return recorded.status, json.loads(recorded.body), True
            try:
                applied = await self._execute(command, self.seq + 1)
            except EngineError as exc:
                status, body = exc.status, exc.to_json()
            else:
                self.seq = applied.seq
                self.commands_applied[command.kind] = self.commands_applied.get(command.kind, 0) + 1
                status, body = 200, applied.model_dump(mode="json")
            self._replay.record(command.command_id, fingerprint, status, body)
            return status, body, False

    async def _execute(self, command: AnyCommand, seq: int) -> RouteApplied | InterruptApplied | AbortApplied | PullApplied:
        """Carry ``command`` out on the engine; its answer, numbered ``seq``."""
        applied = {"command_id": command.command_id, "seq": seq}
        if isinstance(command, RouteCommand):
            try:
                requests = [engine_request(t) for t in command.trajectories]
            except ValueError as exc:  # cross-field checks of the trajectory dataclasses
                raise EngineError(ErrorCode.INVALID_TRAJECTORY, str(exc)) from None
            await self.engine.route(requests)
            for t in command.trajectories:
                if carried := carried_by_instance(t):
                    self._carried[t.traj_id] = carried
            return RouteApplied(**applied, kind="route", routed=[r.traj_id for r in requests])
        if isinstance(command, InterruptCommand):
            result = await self.engine.interrupt(command.traj_ids)
            return InterruptApplied(**applied, kind="interrupt", partials=self._handed_back(result.partials),
                                    not_found=result.not_found)
        if isinstance(command, AbortCommand):
            abort = await self.engine.abort(command.traj_ids)
            for traj_id in abort.aborted:
                self._carried.pop(traj_id, None)
            return AbortApplied(**applied, kind="abort", aborted=abort.aborted, not_found=abort.not_found)
        return await self._pull(command, applied)

    async def _pull(self, command: PullCommand, applied: dict[str, Any]) -> PullApplied:
        self._pulling = True
        try:
            partials = await self.engine.load_weights(weights_ref(command), command.keep_running)
            kept: list[str] = []
            if command.keep_running:  # complete_trajs restarted at the load: all of them went through it
                held = await self.engine.snapshot()
                kept = sorted({*held.run_trajs, *held.wait_trajs, *held.complete_trajs})
        finally:
            self._pulling = False
        return PullApplied(**applied, kind="pull", version=command.version, partials=self._handed_back(partials),
                           kept=kept)

    def _handed_back(self, partials: Iterable[PartialTrajectory]) -> list[WireTrajectory]:
        """Interrupted trajectories as they leave the instance, with what it carried for them."""
        return [wire_trajectory(p, self._carried.pop(p.traj_id, None)) for p in partials]

    async def snapshot(self) -> dict[str, Any]:
        if self._pulling:  # a weight load can take a while: answer without waiting for it
            snap = await self.engine.snapshot()
            return self._snapshot_json(replace(snap, loading_weights=True))
        async with self._lock:
            return self._snapshot_json(await self.engine.snapshot())

    def _snapshot_json(self, snap: EngineSnapshot) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "boot_id": self.boot_id,
            "seq": self.seq,
            "timestamp": time.time(),
            "engine_time": snap.time,
            "kv_cache": snap.kv_cache,
            "run_trajs": list(snap.run_trajs),
            "wait_trajs": list(snap.wait_trajs),
            "complete_trajs": list(snap.complete_trajs),
            "inst_version": snap.inst_version,
            "loading_weights": snap.loading_weights,
            "decode_steps": snap.decode_steps,
            "decode_seconds": snap.decode_seconds,
            "kv_usage": snap.kv_usage,
            "generated": dict(snap.generated) if snap.generated is not None else None,
        }

    async def advance(self, request: AdvanceIn) -> dict[str, Any]:
        engine = self.engine
        if not isinstance(engine, SimEngine):
            raise EngineError(ErrorCode.NOT_SIM, "only the sim engine has a virtual clock to advance")
        async with self._lock:
            if request.until_idle:
                if engine.clock is not Clock.VIRTUAL:
                    raise EngineError(ErrorCode.WRONG_CLOCK, "advance needs the virtual clock; this engine runs on real time")
                await engine.run_until_idle()
            elif request.to is not None:
                if request.to < engine.now:
                    raise EngineError(ErrorCode.TIME_BACKWARDS, f"virtual time is already {engine.now}, cannot go to {request.to}")
                await engine.advance_to(request.to)
            else:
                await engine.advance_by(request.by or 0.0)
            await engine.drained()
            return {"now": engine.now, "completed_seq": self.outbox.next_seq - 1}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "instance_id": self.instance_id,
            "engine": self.config.engine,
            "seq": self.seq,
            "outbox": {
                "last_seq": self.outbox.next_seq - 1,
                "acked": self.outbox.acked,
                "pending": len(self.outbox),
                "dropped": self.outbox.dropped,
            },
            "callback": {"url": self.config.completion_callback_url, "delivered_seq": self.callback_delivered},
        }
