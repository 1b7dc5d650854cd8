"""The reward server's contract: its wire models and its client (sync and async)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from staleflow.api.base import AsyncClient, Client, Route


class RewardItem(BaseModel):
    id: str | int
    response_text: str
    answer: str
    verifier: str | None = None


class RewardOut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | int
    reward: float
    reason: str
    detail: str | None = None


class RewardHealth(BaseModel):
    status: str
    workers: int
    replaced_workers: int
    timeouts: dict[str, int]  # by verifier: items that overran their deadline


class VerifiersOut(BaseModel):
    default: str
    builtin: list[str]
    user: dict[str, str]


class RewardRoutes:
    """The reward server's REST API: ``score(items)`` takes ``[{id, response_text, answer,
    verifier?}]`` (or ``RewardItem``s) and answers a ``RewardOut`` per item, in the same order."""

    health = Route("GET", "/v1/health", RewardHealth)
    verifiers = Route("GET", "/v1/verifiers", VerifiersOut)
    score = Route("POST", "/v1/rewards", list[RewardOut], body="items")


class RewardClient(RewardRoutes, Client):
    """The reward server's client (scoring a batch can take a while: a longer default timeout)."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None):
        super().__init__(url, token, timeout)


class AsyncRewardClient(RewardRoutes, AsyncClient):
    """The reward server's client, for services running on an event loop (the trajectory server)."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None):
        super().__init__(url, token, timeout)
