"""The generic REST client every StaleFlow service client builds on: an httpx client with the bearer
token and TCP_NODELAY, and ``ServiceError`` for a non-2xx reply."""

from __future__ import annotations

import os
import socket
from typing import Any, Self

import httpx

TOKEN_ENV = "STALEFLOW_TOKEN"


def configured_token(token: str | None = None) -> str | None:
    """The explicit token, else the environment's, else none."""
    return token or os.environ.get(TOKEN_ENV) or None


# httpcore writes headers and body separately; without TCP_NODELAY, Nagle's algorithm and the
# peer's delayed ACK stall every request with a body by ~40 ms.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def _auth_headers(token: str | None) -> dict[str, str]:
    token = configured_token(token)
    return {"Authorization": f"Bearer {token}"} if token else {}


def http_client(url: str, token: str | None = None, timeout: float = 10.0,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """An httpx client for a StaleFlow service; the token defaults to $STALEFLOW_TOKEN."""
    headers = _auth_headers(token)
    transport = transport or httpx.HTTPTransport(socket_options=NODELAY)
    return httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)


def async_http_client(url: str, token: str | None = None, timeout: float = 10.0) -> httpx.AsyncClient:
    headers = _auth_headers(token)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                             transport=httpx.AsyncHTTPTransport(socket_options=NODELAY))


class ServiceError(RuntimeError):
    def __init__(self, status: int, detail: str, body: dict | None = None):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.body = body or {}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
        detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
    except ValueError:
        body, detail = None, response.text
    raise ServiceError(response.status_code, str(detail), body if isinstance(body, dict) else None)


class RestClient:
    """A service's REST API over one httpx client: a context manager whose ``_call`` returns the
    JSON reply or raises ``ServiceError`` for a non-2xx one. ``token`` defaults to $STALEFLOW_TOKEN."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None):
        self.http = http_client(url, token, timeout, transport)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()
