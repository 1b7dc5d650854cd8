"""The instance's progress checkpoints over real HTTP on loopback: what it sends, when, and what it
does when the trajectory server refuses or ignores a checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, create_app


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


class Receiver:
    """A stand-in trajectory server: refuses the first checkpoint batch with 503, then keeps what
    continues each response; ``ignore`` lists trajectories it does not route to the instance."""

    def __init__(self) -> None:
        self.bodies: list[tuple[int, dict[str, Any]]] = []  # (status answered, body)
        self.held: dict[str, list[int]] = {}
        self.ignore: set[str] = set()
        self.app = FastAPI()
        self.app.post("/v1/progress")(self.progress)

    async def progress(self, request: Request) -> JSONResponse:
        body = await request.json()
        if not self.bodies:
            self.bodies.append((503, body))
            return JSONResponse({"detail": "restarting"}, status_code=503)
        self.bodies.append((200, body))
        stored, ignored = {}, []
        for p in body["trajectories"]:
            if p["traj_id"] in self.ignore:
                ignored.append(p["traj_id"])
                continue
            have = self.held.setdefault(p["traj_id"], [])
            if p["start"] <= len(have):
                have[p["start"]:] = p["tokens"]
            stored[p["traj_id"]] = len(have)
        return JSONResponse({"stored": stored, "ignored": ignored})


def accepted(receiver: Receiver) -> list[dict[str, Any]]:
    return [p for status, body in receiver.bodies if status == 200 for p in body["trajectories"]]


def test_checkpoints_resend_after_a_refusal_come_every_progress_seconds_and_continue_each_other() -> None:
    receiver = Receiver()
    receiver.ignore.add("b/0")
    with serve_in_thread(receiver.app) as ts:
        config = InstanceConfig(instance_id="inst-0", sim={"workload": "paper-20k", "kv_budget": 10**7},
                                progress_url=f"{ts.url}/v1/progress", progress_tokens=10**6, progress_seconds=0.3)
        with serve_in_thread(create_app(config)) as inst, httpx.Client(base_url=inst.url, timeout=30) as client:
            route = {"command_id": "r1", "kind": "route", "trajectories": [
                {"traj_id": t, "group_id": t.split("/")[0], "prompt_ids": [1, 2, 3], "v_traj": 0,
                 "sampling": {"max_tokens": 8192, "ignore_eos": True}} for t in ("a/0", "b/0")]}
            assert client.post("/v1/commands", json=route).status_code == 200
            client.post("/v1/sim/advance", json={"by": 2.0}).raise_for_status()
            # far below progress_tokens: the checkpoint comes from the progress_seconds sweep

            def caught_up() -> bool:  # the instance took the reply to its checkpoint of a/0
                held = client.get("/v1/progress").json()
                return held["checkpointed"].get("a/0") == held["held"]["a/0"]

            wait_until(caught_up)
            refused_status, refused = receiver.bodies[0]
            first = next(p for p in accepted(receiver) if p["traj_id"] == "a/0")
            assert refused_status == 503 and first["start"] == 0, "a refused checkpoint is sent again from its start"
            assert {p["traj_id"] for p in refused["trajectories"]} == {"a/0", "b/0"}
            held = client.get("/v1/progress").json()
            assert held["checkpointed"]["a/0"] == len(receiver.held["a/0"]) == held["held"]["a/0"]

            client.post("/v1/sim/advance", json={"by": 2.0}).raise_for_status()
            wait_until(caught_up)
            second = [p for p in accepted(receiver) if p["traj_id"] == "a/0"][1]
            assert second["start"] == first["start"] + len(first["tokens"]), "each checkpoint continues the last"
            assert second["segments"] == [{"version": 0, "start": 0, "end": second["start"] + len(second["tokens"])}]
            # an ignored trajectory is not sent again until it has more to send
            sent_b = [p for p in accepted(receiver) if p["traj_id"] == "b/0"]
            assert [p["start"] for p in sent_b] == [0, len(sent_b[0]["tokens"])][: len(sent_b)]

            partial = client.post("/v1/commands", json={"command_id": "i1", "kind": "interrupt",
                                                        "traj_ids": ["a/0"]}).json()["partials"][0]
            assert partial["tokens"][: len(receiver.held["a/0"])] == receiver.held["a/0"]
