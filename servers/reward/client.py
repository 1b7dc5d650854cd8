"""The reward server's REST client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from staleflow.servers.clients import RestClient


class RewardClient(RestClient):
    """The reward server's REST API."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None):
        super().__init__(url, token, timeout)

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def score(self, items: Sequence[dict[str, Any]]) -> list[dict]:
        """``[{id, response_text, answer, verifier?}]`` -> ``[{id, reward, reason, detail?}]``."""
        return self._call("POST", "/v1/rewards", json=list(items))
