"""The staleness manager's contract: its wire models and its client (sync and async)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from staleflow.api.base import AsyncClient, Client, Route

GROUP_ID_PATTERN = r"^[A-Za-z0-9._:@+\-]{1,200}$"
SQL_INT_MAX = 2**63 - 1  # what SQL databases store in an integer column


class ReservationRequest(BaseModel):
    group_id: str = Field(pattern=GROUP_ID_PATTERN, description="prompt group id (single use)")
    v_traj: StrictInt = Field(ge=0, description="the group's trajectory version V_traj")


class Health(BaseModel):
    status: str
    train_version: int


class EntryOut(BaseModel):
    group_id: str
    v_traj: int | None = None  # absent for consumed buffers
    status: str


class BufferOut(BaseModel):
    version: int
    state: str = Field(description="waiting, ready, stuck or consumed")
    capacity: int
    entries: list[EntryOut]


class BuffersOut(BaseModel):
    train_version: int
    eta: int
    batch_size: int
    group_size: int = Field(description="trajectories a group needs completed to be occupied (G)")
    buffers: list[BufferOut]


class WhatIfOut(BaseModel):
    version: int = Field(description="the V_traj asked about")
    count: int = Field(description="how many more groups were asked about")
    admissible: bool = Field(description="whether that many groups with that V_traj could be reserved now")
    room: int = Field(description="how many groups with that V_traj could be reserved now")
    reason: str = Field(description="the answer in words")
    full_buffers: list[int] = Field(description="the buffers with no free slot where the groups would have to go")
    consume_through: int | None = Field(description="consume the buffers from the trainer's version up to this one "
                                                    "first: then that many groups fit (at then_version); null: "
                                                    "nothing to consume")
    then_version: int | None = Field(description="the V_traj that many groups could carry (once consume_through is "
                                                 "consumed; null: admissible now, or never)")
    then_room: int | None = Field(description="the room at then_version then (an estimate when buffers must be "
                                              "consumed first)")


class AdmissionOut(BaseModel):
    train_version: int
    eta: int
    admissible: dict[str, int] = Field(description="V_traj -> groups it can still admit")
    what_if: WhatIfOut | None = Field(default=None, description="the answer to ?version=V&count=N")

    def by_version(self) -> dict[int, int]:
        """``admissible`` keyed by the version itself."""
        return {int(v): n for v, n in self.admissible.items()}


class TransitionOut(BaseModel):
    group_id: str
    buffer: int | None
    cancelled: list[str] = Field(description="groups aborted as a side effect (surplus)")
    completed_members: list[str] | None = None
    occupied: bool | None = None


class ReservationOut(BaseModel):
    group_id: str
    status: str
    v_traj: int | None = None
    completed_members: list[str] | None = None


class ConsumedOut(BaseModel):
    version: int | None
    group_ids: list[str]
    cancelled: list[str]
    replayed: bool


class EventsOut(BaseModel):
    model_config = ConfigDict(extra="forbid")
    events: list[dict[str, Any]]
    next: int


class ManagerRoutes:
    """The staleness manager's REST API."""

    health = Route("GET", "/v1/health", Health)
    buffers = Route("GET", "/v1/buffers", BuffersOut)
    buffer = Route("GET", "/v1/buffers/{version}", BufferOut)
    admission = Route("GET", "/v1/admission", AdmissionOut, query=("versions", "version", "count"))
    reserve = Route("POST", "/v1/reservations", TransitionOut, body=ReservationRequest)
    reservation = Route("GET", "/v1/reservations/{group_id}", ReservationOut)
    occupy = Route("POST", "/v1/reservations/{group_id}/occupy", TransitionOut)
    complete_member = Route("POST", "/v1/reservations/{group_id}/members/{member_id}/complete", TransitionOut)
    abort = Route("DELETE", "/v1/reservations/{group_id}", TransitionOut)
    consume = Route("POST", "/v1/consume", ConsumedOut, query=("version",))
    events = Route("GET", "/v1/events", EventsOut, query=("after", "limit"))


class ManagerClient(ManagerRoutes, Client):
    """The staleness manager's client."""


class AsyncManagerClient(ManagerRoutes, AsyncClient):
    """The staleness manager's client, for services running on an event loop."""
