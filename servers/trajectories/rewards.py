"""The trajectory server's reward functions: simulated, local math verification, or a reward server
over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

from staleflow.api.reward import AsyncRewardClient
from staleflow.config import TrajectoryServerConfig

RewardFn = Callable[[list[tuple[str, str, str]]], Awaitable[list[tuple[float, str]]]]


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
    client = AsyncRewardClient(url, timeout=60.0)

    async def score(batch: list[tuple[str, str, str]]) -> list[tuple[float, str]]:
        scored = await client.score([{"id": i, "response_text": text, "answer": answer} for i, text, answer in batch])
        by_id = {r.id: (r.reward, r.reason) for r in scored}
        return [by_id[i] for i, _, _ in batch]

    return score


def make_reward(config: TrajectoryServerConfig) -> RewardFn:
    if config.reward == "sim":
        return sim_reward(config.seed, config.sim_success_rate)
    if config.reward == "math":
        return local_math_reward()
    return http_reward(config.reward)
