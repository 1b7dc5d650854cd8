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
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from staleflow import metrics as m
from staleflow.api.reward import RewardItem, RewardRoutes
from staleflow.config import RewardConfig
from staleflow.errors import ErrorCode, StaleFlowError
from staleflow.rewards import RewardRequest, RewardScorer
from staleflow.rewards.pool import TIMEOUT
from staleflow.rewards.registry import BUILTIN_VERIFIERS, Verdict
from staleflow.servers.http import Owned, handles, service_app

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


    async def open_scorer() -> RewardScorer:
        return await asyncio.to_thread(RewardScorer, config.verifiers, config.default_verifier, config.workers,
                                       config.timeout_s)

    async def close_scorer(opened: RewardScorer) -> None:
        opened.close()

    def ready(opened: RewardScorer) -> None:
        log.info("reward server ready: verifiers %s, default %s", ", ".join(opened.names()), config.default_verifier)

    app = service_app("StaleFlow reward server",
                      Owned("scorer", open_scorer, close_scorer, given=scorer, owns=owns_scorer, ready=ready))
    tally = RewardTally()
    m.mount_metrics(app, "reward", tally.metrics)

    @handles(app, RewardRoutes.health)
    def health(scorer: ScorerDep) -> dict:
        return {"status": "ok", "workers": scorer.pool.workers, "replaced_workers": scorer.pool.replaced,
                "timeouts": dict(tally.timeouts)}

    @handles(app, RewardRoutes.verifiers)
    def verifiers() -> dict:
        return {"default": config.default_verifier, "builtin": sorted(BUILTIN_VERIFIERS), "user": config.verifiers}

    @handles(app, RewardRoutes.score, response_model_exclude_none=True)
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

