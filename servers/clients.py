"""httpx clients for the StaleFlow services."""

from __future__ import annotations

import socket
from typing import Any, Self

import httpx

from staleflow.servers.auth import configured_token

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


class ManagerClient(RestClient):
    """The staleness manager's REST API."""

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def buffers(self) -> dict:
        return self._call("GET", "/v1/buffers")

    def admission(self, versions: list[int] | None = None) -> dict[int, int]:
        params = {"versions": versions} if versions else None
        return {int(v): n for v, n in self._call("GET", "/v1/admission", params=params)["admissible"].items()}

    def reserve(self, group_id: str, v_traj: int) -> dict:
        return self._call("POST", "/v1/reservations", json={"group_id": group_id, "v_traj": v_traj})

    def occupy(self, group_id: str) -> dict:
        return self._call("POST", f"/v1/reservations/{group_id}/occupy")

    def complete_member(self, group_id: str, member_id: str) -> dict:
        return self._call("POST", f"/v1/reservations/{group_id}/members/{member_id}/complete")

    def abort(self, group_id: str) -> dict:
        return self._call("DELETE", f"/v1/reservations/{group_id}")

    def consume(self, version: int | None = None) -> dict:
        return self._call("POST", "/v1/consume", params={} if version is None else {"version": version})

    def events(self, after: int = 0, limit: int = 100) -> dict:
        return self._call("GET", "/v1/events", params={"after": after, "limit": limit})


async def _araise_for(response: httpx.Response) -> dict:
    _raise_for(response)
    return response.json()


class AsyncManagerClient:
    """The staleness manager's REST API, for services running on an event loop."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0):
        self.http = async_http_client(url, token, timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict:
        return await _araise_for(await self.http.request(method, path, **kwargs))

    async def admission(self) -> dict[int, int]:
        return {int(v): n for v, n in (await self._call("GET", "/v1/admission"))["admissible"].items()}

    async def buffers(self) -> dict:
        return await self._call("GET", "/v1/buffers")

    async def buffer(self, version: int) -> dict:
        return await self._call("GET", f"/v1/buffers/{version}")

    async def reserve(self, group_id: str, v_traj: int) -> dict:
        return await self._call("POST", "/v1/reservations", json={"group_id": group_id, "v_traj": v_traj})

    async def reservation(self, group_id: str) -> dict:
        return await self._call("GET", f"/v1/reservations/{group_id}")

    async def occupy(self, group_id: str) -> dict:
        return await self._call("POST", f"/v1/reservations/{group_id}/occupy")

    async def complete_member(self, group_id: str, member_id: str) -> dict:
        return await self._call("POST", f"/v1/reservations/{group_id}/members/{member_id}/complete")

    async def abort(self, group_id: str) -> dict:
        return await self._call("DELETE", f"/v1/reservations/{group_id}")

    async def consume(self) -> dict:
        return await self._call("POST", "/v1/consume")

    async def events(self, after: int = 0, limit: int = 500) -> dict:
        return await self._call("GET", "/v1/events", params={"after": after, "limit": limit})
