"""The reward server's REST app: verifiable rule-based rewards on CPU, off the rollout path (paper Figure 6).

* ``POST /v1/rewards`` -- a batch ``[{id, response_text, answer, verifier?}]`` -> ``[{id, reward,
  reason, detail?}]`` in the same order. ``verifier`` is a built-in ("math", "exact"), a name from
  the configuration, or a configured "module.path:function"; default: the configured default.
  Every verifier, the built-ins too, runs in a worker process with a deadline per item (``timeout_s``).
  Reasons: "correct", "wrong_answer", "no_answer", "timeout" (the verifier overran its deadline and
  its worker was replaced; counted in ``/v1/health`` and ``staleflow_reward_timeouts_total``),
  "error" (it raised or returned something that is not a reward), or whatever a user verifier says.
* ``GET /v1/verifiers``, ``GET /v1/health``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from staleflow import metrics as m
from staleflow.api.reward import RewardHealth, RewardItem, RewardOut, VerifiersOut
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.rewards import RewardRequest, RewardScorer
from staleflow.rewards.pool import TIMEOUT
from staleflow.rewards.registry import BUILTIN_VERIFIERS, Verdict
from staleflow.servers.http import service_app
from staleflow.servers.reward.config import RewardConfig

log = logging.getLogger(__name__)

class RewardTally:
    """What the reward server scored, for /metrics."""

    def __init__(self) -> None:
        self.batches = 0
        self.batch_seconds = 0.0
        self.by_verifier: dict[str, list[float]] = {}  # verifier -> [items, sum of rewards]
        self.timeouts: dict[str, int] = {}

    def add(self, seconds: float, verdicts: list[tuple[str, Verdict]]) -> None:
        self.batches += 1
        self.batch_seconds += seconds
        for verifier, verdict in verdicts:
            tally = self.by_verifier.setdefault(verifier, [0, 0.0])
            tally[0] += 1
            tally[1] += verdict.reward
            if verdict.reason == TIMEOUT:
                self.timeouts[verifier] = self.timeouts.get(verifier, 0) + 1

    def metrics(self) -> list:
        verifiers = sorted(self.by_verifier.items())
        return [m.REWARD_ITEMS.family([([v], n) for v, (n, _) in verifiers]),
                m.REWARD_TIMEOUTS.family([([v], n) for v, n in sorted(self.timeouts.items())]),
                m.REWARD_SECONDS.summary([((), self.batches, self.batch_seconds)]),
                m.REWARD_VALUE.summary([([v], int(n), total) for v, (n, total) in verifiers])]


async def the_scorer(request: Request) -> RewardScorer:
    return request.app.state.scorer


ScorerDep = Annotated[RewardScorer, Depends(the_scorer)]


def create_app(config: RewardConfig, scorer: RewardScorer | None = None, owns_scorer: bool | None = None) -> FastAPI:
    """The reward server. Closes the scorer (and its worker processes) at shutdown if it made it,
    or if ``owns_scorer``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = scorer is None if owns_scorer is None else owns_scorer
        app.state.scorer = scorer or await asyncio.to_thread(
            RewardScorer, config.verifiers, config.default_verifier, config.workers, config.timeout_s)
        log.info("reward server ready: verifiers %s, default %s", ", ".join(app.state.scorer.names()), config.default_verifier)
        try:
            yield
        finally:
            if owned:
                app.state.scorer.close()

    app = service_app("StaleFlow reward server", lifespan)
    tally = RewardTally()
    m.mount_metrics(app, "reward", tally.metrics)

    @app.get("/v1/health", response_model=RewardHealth)
    def health(scorer: ScorerDep) -> dict:
        return {"status": "ok", "workers": scorer.pool.workers, "replaced_workers": scorer.pool.replaced,
                "timeouts": dict(tally.timeouts)}

    @app.get("/v1/verifiers", response_model=VerifiersOut)
    def verifiers() -> dict:
        return {"default": config.default_verifier, "builtin": sorted(BUILTIN_VERIFIERS), "user": config.verifiers}

    @app.post("/v1/rewards", response_model=list[RewardOut], response_model_exclude_none=True)
    async def rewards(scorer: ScorerDep, items: list[RewardItem]) -> list[dict]:
        if len(items) > config.max_batch:
            raise StaleFlowError(ErrorCode.BATCH_TOO_LARGE, f"{len(items)} items; at most {config.max_batch} per request")
        for item in items:
            if len(item.response_text) > config.max_chars or len(item.answer) > config.max_chars:
                raise StaleFlowError(ErrorCode.BATCH_TOO_LARGE, f"item {item.id!r}: response_text and answer are "
                                                                f"limited to {config.max_chars} characters")
        requests = [RewardRequest(i.response_text, i.answer, i.verifier) for i in items]
        started = time.perf_counter()
        verdicts = await asyncio.to_thread(scorer.score, requests)
        tally.add(time.perf_counter() - started,
                  [(i.verifier or config.default_verifier, v) for i, v in zip(items, verdicts, strict=True)])
        return [{"id": item.id, **verdict.to_json()} for item, verdict in zip(items, verdicts, strict=True)]

    return app

