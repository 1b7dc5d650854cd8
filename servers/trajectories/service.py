"""``TrajectoryServer``: checkout, return and completion of trajectories, rewards, group closing and
the manager's ledger calls, over the durable ``TrajectoryStore``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import httpx

from staleflow.api.base import ServiceError
from staleflow.api.manager import AsyncManagerClient
from staleflow.api.trajectories import (
    BatchOut,
    Cancellation,
    CancellationsOut,
    CheckedOut,
    CheckoutRequest,
    CompletedRequest,
    ProgressRequest,
    ReturnRequest,
    TrajectoriesOut,
    TrajectoryDetail,
    TrajectoryPage,
)
from staleflow.api.trajectory import GeneratedPart
from staleflow.config import TrajectoryServerConfig
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.length_skew import TrajectoryFate
from staleflow.servers.http import background
from staleflow.servers.trajectories.rewards import RewardFn
from staleflow.servers.trajectories.store import GroupRecord, GroupState, StoreConflict, TrajectoryStore, TrajState
from staleflow.servers.trajectories.wire import (
    detail,
    generated,
    progress_checkpoint,
    summary,
    training_trajectory,
    wire_sampling,
    wire_trajectory,
)
from staleflow.tasks import ArithmeticTask, ByteTokenizer, DatasetPrompts, HfTokenizer, SkippedRows
from staleflow.trajectory_book import SegmentLimits

log = logging.getLogger(__name__)


class TrajectoryServer:
    def __init__(self, config: TrajectoryServerConfig, store: TrajectoryStore, manager: AsyncManagerClient,
                 reward: RewardFn):
        self.config = config
        self.store = store
        self.manager = manager
        self.reward = reward
        self.sampling = wire_sampling(config.sampling)
        self.tokenizer = HfTokenizer(config.tokenizer) if config.tokenizer else ByteTokenizer()
        self.prompts = DatasetPrompts(config.dataset, config.prompt_field, config.answer_field,
                                      config.max_prompt_chars) if config.dataset else ArithmeticTask(
                                          config.seed, config.task.digits, config.task.ops)
        self.too_long = SkippedRows()  # prompts over max_prompt_tokens, counted once each, never routed
        self._too_long_seen: set[str] = set()
        self._warned_nothing_fits = False
        params = config.ledger.params()
        self.members, self.needed = params.group_members, params.group_size
        # a group the ledger cancels is surplus of batch redundancy where there is any, else it expired
        # under the staleness bound
        self.cancelled_fate = TrajectoryFate.DROPPED if params.capacity > params.batch_size else TrajectoryFate.ABORTED
        self._work = asyncio.Event()
        self._stopping = False
        self.accepted = 0  # completions accepted from instances since this server started
        self.reward_tally = [0, 0.0]  # rewarded trajectories, sum of their rewards
        self.length_tally = [0, 0]  # rewarded trajectories, sum of their response tokens
        self.checkpointed_tokens = 0  # appended from progress checkpoints since this server started
        # the ledger's train version as last heard: no model newer than it can have been published
        self.train_version = 0

    @classmethod
    def open(cls, config: TrajectoryServerConfig, reward: RewardFn) -> TrajectoryServer:
        """The server over the configured database, its prompt pool topped up."""
        store = TrajectoryStore.open(config.database_url(), retention=config.retention,
                                     lengths_kept=config.finished_lengths_kept)
        server = cls(config, store, AsyncManagerClient(config.manager_url), reward)
        server.refill()
        return server

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The reward loop and the ledger follower run while the block does; anything completed
        before a restart is rewarded first."""
        async with background(self.reward_loop(), self.follow_ledger()):
            self._work.set()
            try:
                yield
            finally:
                self._stopping = True

    async def aclose(self) -> None:
        await self.manager.aclose()
        self.store.close()

    async def segment_limits(self, trajectories: Iterable[GeneratedPart]) -> SegmentLimits:
        """The limits every generated token must keep (``staleflow.trajectory_book.segment_violation``).
        The newest version is the staleness manager's train version: the trainer publishes version
        ``b + 1`` only after consuming buffer ``b``, and the ledger holds that count durably, so it
        survives a restart of any service (the parameter server keeps only its last few versions).
        It is asked again only when a segment claims a version newer than the one last heard."""
        claimed = max((s.version for t in trajectories for s in t.segments), default=-1)
        if claimed > self.train_version:
            self.train_version = max(self.train_version, (await self.manager.health()).train_version)
        return SegmentLimits(self.train_version, self.config.sampling.max_tokens)

    def check_vocabulary(self, trajectories: Iterable[GeneratedPart]) -> None:
        """Refuse the whole request (422 ``invalid_token``) if a token id lies outside the model's
        vocabulary, where the job knows it: an engine serving another model, or a corrupted
        message, whose ids the trainer's embedding could not look up."""
        vocab = self.config.vocab_size
        if vocab is None:
            return
        for t in trajectories:
            if t.tokens and (top := max(t.tokens)) >= vocab:
                raise StaleFlowError(ErrorCode.INVALID_TOKEN,
                                     f"trajectory {t.traj_id}: token id {top} is outside the model's vocabulary of "
                                     f"{vocab} (ids 0..{vocab - 1}); the rollout engine must serve the job's model",
                                     traj_id=t.traj_id, vocab_size=vocab)

    def health(self) -> dict:
        """Answers from memory, never from the database: while the database is down it says so
        (``degraded``, naming the dependency) instead of failing, so the server is not taken for hung."""
        skipped = getattr(self.prompts, "skipped", SkippedRows())
        regenerated = self.store.regenerated
        down = self.store.unavailable
        return {"status": "degraded" if down else "ok", "counts": self.store.counts_in_memory(),
                "dependencies": {"database": f"unavailable: {down}"} if down else {},
                "skipped_prompts": {"count": skipped.count + self.too_long.count,
                                    "reasons": {**skipped.reasons, **self.too_long.reasons}},
                "progress": {"checkpointed_tokens": self.checkpointed_tokens,
                             "failed_over": self.store.failed_over[0], "resumed_tokens": self.store.failed_over[1],
                             "regenerated_trajectories": regenerated[0], "regenerated_tokens": regenerated[1]},
                "staleness_violations": self.staleness_violations()}

    # -- sampling ------------------------------------------------------------------------

    def refill(self) -> int:
        missing = self.config.target_groups() - self.store.live_groups()
        if missing <= 0:
            return 0
        start = int(self.store.meta.get("next_prompt", "0"))
        rows, index = [], start
        while len(rows) < missing and index < start + 100 * missing:  # never spin on a dataset of long prompts
            p = self.prompts.prompt(index)
            index += 1
            ids = tuple(self.tokenizer.encode(p.text))
            if len(ids) > self.config.max_prompt_tokens:
                if p.text not in self._too_long_seen:  # a cycled dataset meets the same row again
                    self._too_long_seen.add(p.text)
                    self.too_long.add(f"prompt longer than {self.config.max_prompt_tokens} tokens")
                continue
            rows.append((p.index, p.text, p.answer, ids))
        if not rows and not self._warned_nothing_fits:
            self._warned_nothing_fits = True
            log.warning("no prompt of the %d read fits max_prompt_tokens=%d: nothing to sample; raise it or "
                        "shorten the dataset's prompts", index - start, self.config.max_prompt_tokens)
        self.store.add_groups(rows, self.members, self.needed, index)
        return len(rows)

    # -- routing -------------------------------------------------------------------------

    def pending(self) -> TrajectoriesOut:
        """Trajectories waiting to be routed (V_traj null: initial)."""
        return TrajectoriesOut(trajectories=[summary(t, g) for t, g in self.store.pending()])

    def routed(self, instance_id: str | None = None) -> TrajectoriesOut:
        return TrajectoriesOut(trajectories=[summary(t, g) for t, g in self.store.routed(instance_id)])

    def release(self, instance_id: str, generated: dict[str, int]) -> dict:
        """The instance was declared failed: its trajectories become routable again (see
        ``TrajectoryStore.release_instance``)."""
        return {"released": self.store.release_instance(instance_id, generated)}

    def cancellations(self) -> CancellationsOut:
        return CancellationsOut(trajectories=[Cancellation(traj_id=t.traj_id, instance_id=t.instance_id)
                                              for t in self.store.cancellations()])

    def cancellations_done(self, traj_ids: list[str]) -> dict:
        self.store.cancelled(traj_ids)
        return {"acknowledged": len(traj_ids)}

    async def checkout(self, request: CheckoutRequest) -> CheckedOut:
        assignments = [(a.traj_id, a.v_traj) for a in request.assignments]
        not_reserved = {}
        for group_id, v_traj in self.store.reservations_needed(assignments).items():
            reason = await self._reserve(self.store.groups[group_id], v_traj)
            if reason:
                not_reserved[group_id] = reason
        granted, refused = self.store.grant(assignments, not_reserved)
        routed = self.store.checkout(request.instance_id, granted) if granted else []
        return CheckedOut(trajectories=[wire_trajectory(t, g, self.sampling) for t, g in routed],
                          refused=[{"traj_id": traj_id, "reason": reason} for traj_id, reason in refused])

    async def _reserve(self, g: GroupRecord, v_traj: int) -> str | None:
        """Reserve the group in the ledger (durably) before any member is routed."""
        try:
            await self.manager.reserve(g.group_id, v_traj)
        except ServiceError as exc:
            if exc.code is not ErrorCode.DUPLICATE_GROUP:
                return exc.detail
            existing = await self.manager.reservation(g.group_id)  # reserved before a crash of the TS
            if existing.status not in ("reserved", "occupied") or existing.v_traj is None:
                return f"the ledger has this group as {existing.status}"
            v_traj = existing.v_traj
        self.store.set_group_version(g.group_id, v_traj)
        return None

    def staleness_violations(self) -> int:
        """Trained trajectories with a token older than the bound allows (the length-skew
        accounting's staleness, measured from each trajectory's oldest segment version)."""
        return self.store.length_skew_totals()[0].violations(self.config.ledger.eta)

    def metrics(self) -> list:
        """Prometheus view of the trajectory server, read at scrape time."""
        from staleflow import metrics as m

        return [
            m.TRAJECTORIES.family([([state], n) for state, n in sorted(self.store.counts().items())]),
            m.TRAJECTORIES_COMPLETED.value(self.accepted),
            m.TRAJECTORY_REWARD.summary([((), int(self.reward_tally[0]), self.reward_tally[1])]),
            m.TRAJECTORY_RESPONSE_TOKENS.summary([((), self.length_tally[0], self.length_tally[1])]),
            m.TRAJECTORY_CHECKPOINTED_TOKENS.value(self.checkpointed_tokens),
            m.TRAJECTORIES_FAILED_OVER.value(self.store.failed_over[0]),
            m.TRAJECTORY_FAILURE_RESUMED_TOKENS.value(self.store.failed_over[1]),
            m.TRAJECTORY_FAILURE_REGENERATED_TOKENS.value(self.store.regenerated[1]),
            m.TRAJECTORY_STALENESS_VIOLATIONS.value(self.staleness_violations()),
            *m.length_skew_families(*self.store.length_skew_totals()),
        ]

    async def progress(self, request: ProgressRequest) -> dict:
        """Checkpoints of running trajectories (see ``TrajectoryBook.checkpoint``)."""
        limits = await self.segment_limits(request.trajectories)
        before = {p.traj_id: len(t.tokens) for p in request.trajectories if (t := self.store.trajs.get(p.traj_id))}
        stored = self.store.checkpoint([progress_checkpoint(p, request.instance_id) for p in request.trajectories],
                                       request.instance_id, request.held, limits)
        self.checkpointed_tokens += sum(n - before.get(traj_id, n) for traj_id, n in stored.items())
        return {"stored": stored, "ignored": [p.traj_id for p in request.trajectories if p.traj_id not in stored]}

    # -- completion, rewards, occupation --------------------------------------------------

    async def returned(self, request: ReturnRequest) -> dict[str, str]:
        """Trajectories handed back (see ``TrajectoryBook.returned``)."""
        limits = await self.segment_limits(request.partials)
        return self.store.returned([generated(p) for p in request.partials], request.instance_id, limits)

    async def completed(self, request: CompletedRequest) -> int:
        limits = await self.segment_limits(item.trajectory for item in request.items)
        fresh = self.store.completed([generated(it.trajectory, it.instance_id or request.instance_id)
                                      for it in request.items], limits)
        self.accepted += len(fresh)
        if fresh:
            self._work.set()
        return len(fresh)

    async def reward_loop(self) -> None:
        while not self._stopping:
            await self._work.wait()
            self._work.clear()
            try:
                await self.process_completed()
            except Exception as exc:  # a failing reward backend or ledger (restarting): retry shortly
                if isinstance(exc, httpx.TransportError):
                    log.warning("processing completed trajectories failed (%s: the manager or reward server "
                                "is unreachable); retrying", exc.__class__.__name__)
                else:
                    log.exception("processing completed trajectories failed; retrying")
                await asyncio.sleep(0.5)  # retry pacing while a peer restarts
                self._work.set()

    async def process_completed(self) -> None:
        todo = self.store.completed_ones()
        if todo:
            batch = [(t.traj_id, self.tokenizer.decode(t.tokens), self.store.groups[t.group_id].answer) for t in todo]
            scores = await self.reward(batch)
            self.store.rewarded({t.traj_id: s for t, s in zip(todo, scores, strict=True)})
            self.reward_tally[0] += len(scores)
            self.reward_tally[1] += sum(float(reward) for reward, _ in scores)
            self.length_tally[0] += len(todo)
            self.length_tally[1] += sum(len(t.tokens) for t in todo)
        # every group with enough rewarded members, including those whose Occupy failed before
        # (the manager restarting) or was cut short by a restart of this server
        for g in self.store.closable_groups():
            await self._close_reserved_group(g)
        self.refill()

    async def _close_reserved_group(self, g: GroupRecord) -> None:
        rewards = [t.reward for t in self.store.group_rewarded(g)][: g.needed]
        if self.config.filter_zero_variance and len(set(rewards)) == 1:
            await self._ledger_call(self.manager.abort, g.group_id, ok_codes={ErrorCode.UNKNOWN_GROUP, ErrorCode.RETIRED_GROUP})
            self.store.close_group(g.group_id, GroupState.ABORTED, TrajectoryFate.FILTERED)
            return
        reply = await self._ledger_call(self.manager.occupy, g.group_id, ok_codes={ErrorCode.INVALID_STATUS})
        self.store.close_group(g.group_id, GroupState.OCCUPIED)
        self.store.follow_ledger("occupy", g.group_id, [], reply.cancelled if reply else [], self.cancelled_fate)

    async def _ledger_call(self, fn, group_id: str, ok_codes: set[ErrorCode]):
        try:
            return await fn(group_id)
        except ServiceError as exc:
            if exc.code in ok_codes:  # already applied before a retry or a restart
                return None
            raise

    async def follow_ledger(self) -> None:
        """Surplus groups aborted by the ledger (redundancy) are cancelled here too."""
        cursor = int(self.store.meta.get("ledger_cursor", "0"))
        while not self._stopping:
            try:
                page = await self.manager.events(after=cursor)
            except Exception as exc:  # the manager may be restarting: keep trying
                log.debug("ledger event poll failed: %s", exc)
            else:
                for event in page.events:
                    self.apply_ledger_event(event)
                if page.next != cursor:
                    cursor = page.next
                    self.store.set_meta("ledger_cursor", str(cursor))
                    self.refill()
                    continue
            await asyncio.sleep(self.config.follow_interval)  # poll pacing

    def apply_ledger_event(self, event: dict) -> None:
        """One transition of the ledger's event log (see ``TrajectoryBook.follow_ledger``)."""
        detail, consume = event["detail"], event["op"] == "consume"
        if consume and event.get("buffer") is not None:  # buffer b consumed: version b + 1 may be published
            self.train_version = max(self.train_version, event["buffer"] + 1)
        self.store.follow_ledger(event["op"], event.get("group_id"), detail.get("consumed", []) if consume else [],
                                 detail.get("cancelled", []), self.cancelled_fate, event.get("buffer") if consume else None)

    # -- the trainer's side --------------------------------------------------------------

    async def batch(self, version: int) -> BatchOut:
        buffer = await self.manager.buffer(version)
        if buffer.state != "consumed":
            raise StoreConflict(f"buffer {version} has not been consumed yet (it is {buffer.state})",
                                ErrorCode.NOT_CONSUMED)
        group_ids = [e.group_id for e in buffer.entries]
        items = self.store.batch(group_ids)
        return BatchOut(version=version, groups=group_ids,
                        trajectories=[training_trajectory(t, g, self.sampling) for t, g in items])

    async def free_batch(self, version: int) -> dict:
        buffer = await self.manager.buffer(version)
        freed = self.store.free([e.group_id for e in buffer.entries], version)
        self.refill()
        return {"version": version, "freed_groups": freed}

    # -- inspection ----------------------------------------------------------------------

    def trajectories(self, state: TrajState | None, limit: int, offset: int) -> TrajectoryPage:
        rows = self.store.listed(state)
        return TrajectoryPage(counts=self.store.counts(), total=len(rows),
                              trajectories=[summary(t, g) for t, g in rows[offset: offset + limit]])

    def trajectory(self, traj_id: str) -> TrajectoryDetail:
        found = self.store.trajectory(traj_id)
        if found is None:
            raise StaleFlowError(ErrorCode.UNKNOWN_TRAJECTORY, f"trajectory {traj_id!r} is unknown")
        t, g, held_on_instance = found
        return detail(t, g, self.sampling, held_on_instance)
