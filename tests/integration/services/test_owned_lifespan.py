"""``Owned``, the one lifespan of every service: what it opens it closes, what it is given it
leaves to its owner unless told otherwise, what runs beside the handlers stops before the resource
closes, and a failure to start still closes what was opened."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from staleflow.servers.http import Owned, service_app


class Resource:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    async def close(self) -> None:
        self.log.append(f"close {self.name}")


def owned(log: list[str], **kwargs: object) -> Owned[Resource]:
    async def open_() -> Resource:
        log.append("open")
        return Resource(log, "opened")

    return Owned("thing", open_, Resource.close, **kwargs)


def served(app: FastAPI) -> str:
    with TestClient(app):
        return app.state.thing.name


def test_what_it_opens_it_closes_and_what_it_is_given_it_leaves() -> None:
    log: list[str] = []
    assert served(service_app("t", owned(log))) == "opened"
    assert log == ["open", "close opened"]
    log.clear()
    assert served(service_app("t", owned(log, given=Resource(log, "given")))) == "given"
    assert log == []
    assert served(service_app("t", owned(log, given=Resource(log, "given"), owns=True))) == "given"
    assert log == ["close given"]


def test_what_runs_beside_the_handlers_stops_before_the_resource_closes() -> None:
    log: list[str] = []

    @asynccontextmanager
    async def running(app: FastAPI, resource: Resource) -> AsyncIterator[None]:
        log.append(f"run beside {resource.name}")
        yield
        log.append("stop")

    served(service_app("t", owned(log, running=running, ready=lambda r: log.append(f"ready {r.name}"))))
    assert log == ["open", "run beside opened", "ready opened", "stop", "close opened"]


def test_a_failed_start_closes_what_was_opened() -> None:
    log: list[str] = []

    @asynccontextmanager
    async def running(app: FastAPI, resource: Resource) -> AsyncIterator[None]:
        raise OSError("the second listener cannot bind")
        yield

    with pytest.raises(OSError, match="cannot bind"):
        served(service_app("t", owned(log, running=running)))
    assert log == ["open", "close opened"]
