"""The trajectory server (TS): the data plane between the dataset, rollout instances, the reward
function, the staleness manager and the trainer (paper §3 Figure 6, §5.1)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator, model_validator

from staleflow.config import HttpUrl, LedgerConfig, ServiceConfig, TaskConfig, check_database_url
from staleflow.servers.clients import AsyncManagerClient, ServiceError, async_http_client
from staleflow.servers.trajectory_store import (
    GroupRecord,
    GroupState,
    StoreConflict,
    StoreUnavailable,
    TrajectoryStore,
    TrajRecord,
    TrajState,
)
from staleflow.tasks import ArithmeticTask, ByteTokenizer, DatasetPrompts, HfTokenizer, SkippedRows

log = logging.getLogger(__name__)

RewardFn = Callable[[list[tuple[str, str, str]]], Awaitable[list[tuple[float, str]]]]


class SamplingConfig(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}
    max_tokens: int = Field(1024, ge=1, description="response length limit per trajectory")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class TrajectoryServerConfig(ServiceConfig):
    ledger: LedgerConfig = LedgerConfig()
    manager_url: HttpUrl = "http://127.0.0.1:8321"
    state_dir: Path = Path(".staleflow")
    db_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite file in the state directory")
    _db_url_supported = field_validator("db_url")(check_database_url)
    dataset: Path | None = Field(None, description="JSONL or Parquet with prompt and answer fields; default: built-in task")
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    max_prompt_chars: int = Field(8192, ge=1)
    max_prompt_tokens: int = Field(4096, ge=1, description="prompts longer than this (in tokens) are skipped and counted")
    tokenizer: Path | None = Field(None, description="the model's tokenizer (directory or tokenizer.json); "
                                                     "default: UTF-8 bytes, for simulated engines")
    task: TaskConfig = TaskConfig(digits=3, ops="+-*")
    seed: int = 0
    sampling: SamplingConfig = SamplingConfig()
    reward: Literal["math", "sim"] | str = Field(
        "math", description="'math' (built-in verifier), 'sim' (seeded random, for the sim engine) or a reward server URL"
    )
    sim_success_rate: float = Field(0.5, ge=0, le=1, description="mean reward of the 'sim' reward")
    filter_zero_variance: bool = Field(False, description="DAPO: abort groups whose rewards are all equal")
    follow_interval: float = Field(0.2, gt=0, description="seconds between polls of the ledger's event log")

    @model_validator(mode="after")
    def _reward_choice(self) -> TrajectoryServerConfig:
        if self.reward not in ("math", "sim") and not self.reward.startswith(("http://", "https://")):
            raise ValueError(f"reward must be 'math', 'sim' or a reward server URL, got {self.reward!r}")
        return self

    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.state_dir / 'trajectories.db').resolve()}"

    def target_groups(self) -> int:
        """Groups kept in flight: (eta + 1) x the groups admitted per buffer."""
        return (self.ledger.eta + 1) * self.ledger.params().capacity


# ---------------------------------------------------------------------------- rewards


def sim_reward(seed: int, success_rate: float) -> RewardFn:
    """A seeded stand-in reward for the simulated engine, whose tokens carry no meaning: each
    prompt gets a difficulty, each trajectory succeeds with that probability."""

    def draw(key: str) -> float:
        return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "big") / 2**64

    async def score(batch: list[tuple[str, str, str]]) -> list[tuple[float, str]]:
        out = []
        for traj_id, _, _ in batch:
            group = traj_id.rsplit("-m", 1)[0]
            p = min(1.0, 2 * success_rate * draw(group))
            out.append((1.0 if draw(traj_id) < p else 0.0, "sim"))
        return out

    return score


def local_math_reward() -> RewardFn:
    """The built-in math verifier, in process (it is pure and fast; user verifiers that may hang
    belong in the reward server, which times them out)."""
    from staleflow.rewards import verify_math

    async def score(batch: list[tuple[str, str, str]]) -> list[tuple[float, str]]:
        return await asyncio.to_thread(lambda: [verify_math(text, answer)[:2] for _, text, answer in batch])

    return score


def http_reward(url: str) -> RewardFn:
    """The reward server (``staleflow serve reward``): batched, with a timeout per call."""
    client = async_http_client(url, timeout=60.0)

    async def score(batch: list[tuple[str, str, str]]) -> list[tuple[float, str]]:
        reply = await client.post("/v1/rewards", json=[
            {"id": i, "response_text": text, "answer": answer} for i, text, answer in batch])
        reply.raise_for_status()
        by_id = {r["id"]: (float(r["reward"]), r.get("reason", "")) for r in reply.json()}
        return [by_id[i] for i, _, _ in batch]

    return score


def make_reward(config: TrajectoryServerConfig) -> RewardFn:
    if config.reward == "sim":
        return sim_reward(config.seed, config.sim_success_rate)
    if config.reward == "math":
        return local_math_reward()
    return http_reward(config.reward)


# ---------------------------------------------------------------------------- wire models


class Assignment(BaseModel):
    traj_id: str
    v_traj: int = Field(ge=0)


class CheckoutRequest(BaseModel):
    instance_id: str = Field(min_length=1, max_length=200)
    assignments: list[Assignment] = Field(min_length=1, max_length=100_000)


class SegmentIn(BaseModel):
    version: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=1)


class PartialIn(BaseModel):
    traj_id: str
    tokens: list[int] = []
    logprobs: list[float] = []
    segments: list[SegmentIn] = []

    @model_validator(mode="after")
    def _consistent(self) -> PartialIn:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"{self.traj_id}: {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if (self.segments[-1].end if self.segments else 0) != len(self.tokens):
            raise ValueError(f"{self.traj_id}: segments do not cover the tokens")
        return self


class ReturnRequest(BaseModel):
    instance_id: str | None = Field(None, min_length=1, max_length=200)
    partials: list[PartialIn] = Field(max_length=100_000)


class CompletedTrajectoryIn(PartialIn):
    finish_reason: Literal["stop", "length", "abort"]


class CompletedItem(BaseModel):
    seq: int | None = None
    instance_id: str | None = Field(None, min_length=1, max_length=200)
    trajectory: CompletedTrajectoryIn


class CompletedRequest(BaseModel):
    instance_id: str = Field(min_length=1, max_length=200)
    items: list[CompletedItem] = Field(max_length=100_000)


class AckRequest(BaseModel):
    traj_ids: list[str] = Field(max_length=100_000)


def traj_payload(t: TrajRecord, g: GroupRecord, sampling: SamplingConfig) -> dict:
    """The trajectory as an instance's Route command carries it."""
    return {
        "traj_id": t.traj_id,
        "group_id": g.group_id,
        "prompt_ids": list(g.prompt_ids),
        "v_traj": g.v_traj,
        "sampling": {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p},
        "tokens": list(t.tokens),
        "logprobs": list(t.logprobs),
        "segments": [{"version": v, "start": s, "end": e} for v, s, e in t.segments],
    }


def summary(t: TrajRecord, g: GroupRecord) -> dict:
    return {"traj_id": t.traj_id, "group_id": g.group_id, "state": t.state.value, "v_traj": g.v_traj,
            "length": len(g.prompt_ids) + len(t.tokens), "generated": len(t.tokens), "instance_id": t.instance_id,
            "seq": t.seq}


# ---------------------------------------------------------------------------- the service


class TrajectoryServer:
    def __init__(self, config: TrajectoryServerConfig, store: TrajectoryStore, manager: AsyncManagerClient,
                 reward: RewardFn):
        self.config = config
        self.store = store
        self.manager = manager
        self.reward = reward
        self.tokenizer = HfTokenizer(config.tokenizer) if config.tokenizer else ByteTokenizer()
        self.prompts = DatasetPrompts(config.dataset, config.prompt_field, config.answer_field,
                                      config.max_prompt_chars) if config.dataset else ArithmeticTask(
                                          config.seed, config.task.digits, config.task.ops)
        self.too_long = SkippedRows()  # prompts over max_prompt_tokens, counted once each, never routed
        self._too_long_seen: set[str] = set()
        self._warned_nothing_fits = False
        params = config.ledger.params()
        self.members, self.needed = params.group_members, params.group_size
        self._work = asyncio.Event()
        self._stopping = False

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

    async def checkout(self, request: CheckoutRequest) -> dict:
        refused: list[dict] = []
        granted: list[str] = []
        for a in request.assignments:
            t = self.store.trajs.get(a.traj_id)
            if t is None or t.state is not TrajState.PENDING:
                refused.append({"traj_id": a.traj_id, "reason": "not pending" if t else "unknown trajectory"})
                continue
            g = self.store.groups[t.group_id]
            if g.state is GroupState.SAMPLED:
                reason = await self._reserve(g, a.v_traj)
                if reason:
                    refused.append({"traj_id": a.traj_id, "reason": reason})
                    continue
            if g.state is not GroupState.RESERVED:
                refused.append({"traj_id": a.traj_id, "reason": f"group is {g.state.value}"})
            elif g.v_traj != a.v_traj:
                refused.append({"traj_id": a.traj_id, "reason": f"group has v_traj {g.v_traj}, not {a.v_traj}"})
            else:
                granted.append(a.traj_id)
        routed = self.store.checkout(request.instance_id, granted) if granted else []
        return {"trajectories": [traj_payload(t, g, self.config.sampling) for t, g in routed], "refused": refused}

    async def _reserve(self, g: GroupRecord, v_traj: int) -> str | None:
        """Reserve the group in the ledger (durably) before any member is routed."""
        try:
            await self.manager.reserve(g.group_id, v_traj)
        except ServiceError as exc:
            if exc.body.get("code") != "duplicate_group":
                return exc.detail
            existing = await self.manager.reservation(g.group_id)  # reserved before a crash of the TS
            if existing.get("status") not in ("reserved", "occupied"):
                return f"the ledger has this group as {existing.get('status')}"
            v_traj = existing["v_traj"]
        self.store.set_group_version(g.group_id, v_traj)
        return None

    # -- completion, rewards, occupation --------------------------------------------------

    async def completed(self, request: CompletedRequest) -> int:
        items = [{"instance_id": it.instance_id or request.instance_id, "trajectory": it.trajectory.model_dump()}
                 for it in request.items]
        fresh = self.store.completed(items)
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
        todo = [t for t in self.store.trajs.values() if t.state is TrajState.COMPLETED]
        if todo:
            batch = [(t.traj_id, self.tokenizer.decode(t.tokens), self.store.groups[t.group_id].answer) for t in todo]
            scores = await self.reward(batch)
            self.store.rewarded({t.traj_id: s for t, s in zip(todo, scores, strict=True)})
        # every group with enough rewarded members, including those whose Occupy failed before
        # (the manager restarting) or was cut short by a restart of this server
        for g in self.store.closable_groups():
            await self._close_reserved_group(g)
        self.refill()

    async def _close_reserved_group(self, g: GroupRecord) -> None:
        rewards = [t.reward for t in self.store.group_rewarded(g)][: g.needed]
        if self.config.filter_zero_variance and len(set(rewards)) == 1:
            await self._ledger_call(self.manager.abort, g.group_id, ok_codes=("unknown_group", "retired_group"))
            self.store.close_group(g.group_id, GroupState.ABORTED)
            return
        reply = await self._ledger_call(self.manager.occupy, g.group_id, ok_codes=("invalid_status",))
        self.store.close_group(g.group_id, GroupState.OCCUPIED)
        for cancelled in (reply or {}).get("cancelled", []):
            self.cancel_group(cancelled)

    async def _ledger_call(self, fn, group_id: str, ok_codes: tuple[str, ...]):  # noqa: ANN001, ANN202
        try:
            return await fn(group_id)
        except ServiceError as exc:
            if exc.body.get("code") in ok_codes:  # already applied before a retry or a restart
                return None
            raise

    def cancel_group(self, group_id: str) -> None:
        if group_id in self.store.groups:
            self.store.close_group(group_id, GroupState.ABORTED)

    async def follow_ledger(self) -> None:
        """Surplus groups aborted by the ledger (redundancy) are cancelled here too."""
        cursor = int(self.store.meta.get("ledger_cursor", "0"))
        while not self._stopping:
            try:
                page = await self.manager.events(after=cursor)
            except Exception as exc:  # the manager may be restarting: keep trying
                log.debug("ledger event poll failed: %s", exc)
            else:
                for event in page["events"]:
                    if event["op"] == "consume":
                        self.store.mark_consumed(event["detail"].get("consumed", []))
                    for group_id in event["detail"].get("cancelled", []):
                        self.cancel_group(group_id)
                    if event["op"] == "abort" and event["group_id"] in self.store.groups:
                        self.cancel_group(event["group_id"])
                if page["next"] != cursor:
                    cursor = page["next"]
                    self.store.set_meta("ledger_cursor", str(cursor))
                    self.refill()
                    continue
            await asyncio.sleep(self.config.follow_interval)  # poll pacing

    # -- the trainer's side --------------------------------------------------------------

    async def batch(self, version: int) -> dict:
        buffer = await self.manager.buffer(version)
        if buffer.get("state") != "consumed":
            raise StoreConflict(f"buffer {version} has not been consumed yet (it is {buffer.get('state')})")
        group_ids = [e["group_id"] for e in buffer["entries"]]
        items = self.store.batch(group_ids)
        return {
            "version": version,
            "groups": group_ids,
            "trajectories": [
                {**traj_payload(t, g, self.config.sampling), "reward": t.reward, "finish_reason": t.finish_reason,
                 "answer": g.answer}
                for t, g in items
            ],
        }


def create_app(config: TrajectoryServerConfig, reward: RewardFn | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = TrajectoryStore.open(config.database_url())
        manager = AsyncManagerClient(config.manager_url)
        server = TrajectoryServer(config, store, manager, reward or make_reward(config))
        server.refill()
        app.state.ts = server
        tasks = [asyncio.create_task(server.reward_loop()), asyncio.create_task(server.follow_ledger())]
        server._work.set()  # reward anything completed before a restart
        try:
            yield
        finally:
            server._stopping = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await manager.aclose()
            store.close()

    app = FastAPI(title="StaleFlow trajectory server", version="1", lifespan=lifespan)

    @app.exception_handler(StoreConflict)
    async def _conflict(_: Request, exc: StoreConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "code": "store_unavailable"}, status_code=503)

    @app.exception_handler(ServiceError)
    async def _upstream(_: Request, exc: ServiceError) -> JSONResponse:
        # the manager's refusal of what the client asked (e.g. an unknown buffer) is the client's 4xx
        status = exc.status if 400 <= exc.status < 500 else 502
        return JSONResponse({"detail": f"staleness manager: {exc.detail}"}, status_code=status)

    @app.exception_handler(httpx.TransportError)
    async def _unreachable(_: Request, exc: httpx.TransportError) -> JSONResponse:
        return JSONResponse({"detail": f"staleness manager unreachable: {exc.__class__.__name__}"}, status_code=503)

    def ts(request: Request) -> TrajectoryServer:
        return request.app.state.ts

    @app.get("/v1/health")
    async def health(request: Request) -> dict:
        server = ts(request)
        skipped = getattr(server.prompts, "skipped", SkippedRows())
        return {"status": "ok", "counts": server.store.counts(),
                "skipped_prompts": {"count": skipped.count + server.too_long.count,
                                    "reasons": {**skipped.reasons, **server.too_long.reasons}}}

    @app.get("/v1/pending")
    async def pending(request: Request) -> dict:
        """Trajectories waiting to be routed, for the coordinator (V_traj null: initial)."""
        return {"trajectories": [summary(t, g) for t, g in ts(request).store.pending()]}

    @app.get("/v1/routed")
    async def routed(request: Request, instance_id: str | None = None) -> dict:
        return {"trajectories": [summary(t, g) for t, g in ts(request).store.routed(instance_id)]}

    @app.post("/v1/checkout")
    async def checkout(request: Request, body: CheckoutRequest) -> dict:
        return await ts(request).checkout(body)

    @app.post("/v1/return")
    async def give_back(request: Request, body: ReturnRequest) -> dict:
        outcome = ts(request).store.returned([p.model_dump() for p in body.partials], body.instance_id)
        return {"outcome": outcome}

    @app.post("/v1/completed")
    async def completed(request: Request, body: CompletedRequest) -> dict:
        return {"accepted": await ts(request).completed(body)}

    @app.post("/v1/instances/{instance_id}/release")
    async def release(request: Request, instance_id: str) -> dict:
        """The coordinator declared the instance failed: its trajectories become routable again."""
        return {"released": ts(request).store.release_instance(instance_id)}

    @app.get("/v1/cancellations")
    async def cancellations(request: Request) -> dict:
        return {"trajectories": [{"traj_id": t.traj_id, "instance_id": t.instance_id}
                                 for t in ts(request).store.cancellations()]}

    @app.post("/v1/cancellations/ack")
    async def cancellations_ack(request: Request, body: AckRequest) -> dict:
        ts(request).store.cancelled(body.traj_ids)
        return {"acknowledged": len(body.traj_ids)}

    @app.get("/v1/batches/{version}")
    async def batch(request: Request, version: int) -> dict:
        if version < 0:
            return JSONResponse({"detail": "version must be >= 0"}, status_code=422)
        return await ts(request).batch(version)

    @app.delete("/v1/batches/{version}")
    async def free_batch(request: Request, version: int) -> dict:
        server = ts(request)
        buffer = await server.manager.buffer(version)
        freed = server.store.free([e["group_id"] for e in buffer.get("entries", [])])
        server.refill()
        return {"version": version, "freed_groups": freed}

    @app.get("/v1/trajectories")
    async def trajectories(
        request: Request,
        state: TrajState | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict:
        store = ts(request).store
        with store.lock:
            rows = [(t, store.groups[t.group_id]) for t in store.trajs.values() if state is None or t.state is state]
        return {"counts": store.counts(), "total": len(rows),
                "trajectories": [summary(t, g) for t, g in rows[offset: offset + limit]]}

    @app.get("/v1/trajectories/{traj_id}")
    async def trajectory(request: Request, traj_id: str) -> dict:
        store = ts(request).store
        t = store.trajs.get(traj_id)
        if t is None:
            return JSONResponse({"detail": f"trajectory {traj_id!r} is unknown"}, status_code=404)
        g = store.groups[t.group_id]
        return {**summary(t, g), **traj_payload(t, g, ts(request).config.sampling), "reward": t.reward,
                "reward_reason": t.reward_reason, "finish_reason": t.finish_reason, "prompt_text": g.prompt_text}

    return app
