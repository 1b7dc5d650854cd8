"""httpx clients for the StaleFlow services."""

from __future__ import annotations

from typing import Any

import httpx

from staleflow.transports.rest import (  # noqa: F401  (re-exported: the services' clients build on these)
    NODELAY,
    RestClient,
    ServiceError,
    _raise_for,
    async_http_client,
    http_client,
)


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
