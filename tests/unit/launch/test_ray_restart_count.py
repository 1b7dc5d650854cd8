"""The Ray launcher's ``restart`` counts a component's restarts from the process the supervisor
last saw alive: Ray's one restart of a killed actor is a recovery even when Ray's actor table
could not say anything at the moment the supervisor looked, and a second restart (the first one
died while starting) is still a failed restart. Ray itself is replaced by a script of its answers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from staleflow.launch.ray import job as ray_job
from staleflow.launch.ray.job import RayClusterJob


class _ActorError(Exception):
    """Ray's RayActorError (ActorUnavailableError while the actor restarts)."""


class _Timeout(Exception):
    pass


class _ScriptedRay:
    class exceptions:
        RayActorError = _ActorError
        GetTimeoutError = _Timeout

    def __init__(self, answers: list[Any]):
        self.answers = answers

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def kill(self, actor: Any, no_restart: bool) -> None:
        raise AssertionError("a dead actor is not killed again")


class _Actor:
    class info:
        @staticmethod
        def remote() -> str:
            return "call"


def _job(answers: list[Any], seen_alive: tuple[int, int]) -> RayClusterJob:
    job = RayClusterJob.__new__(RayClusterJob)
    job.ray = _ScriptedRay(answers)
    job.actors = {"relay-0": _Actor()}
    job._incarnations = {"relay-0": seen_alive}
    job.stop = threading.Event()
    job.state = Path("/nonexistent")
    job._start_timeout = lambda: 30.0  # type: ignore[method-assign]
    return job


def _views(monkeypatch: pytest.MonkeyPatch, views: list[dict]) -> None:
    monkeypatch.setattr(ray_job, "actor_views", lambda ray, actor=None: views.pop(0) if len(views) > 1 else views[0])
    monkeypatch.setattr(ray_job.time, "sleep", lambda s: None)


def test_one_restart_by_ray_is_a_recovery_when_the_first_view_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # killed after its first start (0 restarts, pid 11): Ray's table cannot answer as the supervisor
    # looks, the first call fails while Ray restarts it, then it answers as restart number 1
    _views(monkeypatch, [{}, {"State": "ALIVE", "NumRestarts": 1, "Pid": 12}])
    job = _job([_ActorError("unavailable: restarting"), {"pid": 12}], seen_alive=(0, 11))
    assert job.restart("relay-0") == 12
    assert job._incarnations["relay-0"] == (1, 12)


def test_a_restart_that_died_while_starting_is_still_a_failed_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    _views(monkeypatch, [{}, {"State": "RESTARTING", "NumRestarts": 2, "Pid": None}])
    job = _job([_ActorError("unavailable: restarting")], seen_alive=(0, 11))
    with pytest.raises(RuntimeError, match="relay-0 died again while starting"):
        job.restart("relay-0")
