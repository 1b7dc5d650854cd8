"""The instance server over real HTTP on loopback, driving the sim engine on its virtual clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from typer.testing import CliRunner

from staleflow.cli.serve_instance import build_config, register
from staleflow.config.engines import SimParams
from staleflow.engines.base import SamplingParams, TrajectoryRequest
from staleflow.engines.sim import SimCore
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, create_app
from staleflow.servers.instance.service import CALLBACK_ERROR_ATTEMPTS
from staleflow.workload import preset


def sim_config(instance_id: str = "inst-0", **sim: Any) -> InstanceConfig:
    return InstanceConfig(instance_id=instance_id, sim={"workload": "ci-tiny", "workload_seed": 3, **sim})


@pytest.fixture
def serve() -> Iterator[Callable[[InstanceConfig], httpx.Client]]:
    servers, clients = [], []

    def start(config: InstanceConfig) -> httpx.Client:
        server = serve_in_thread(create_app(config))
        servers.append(server)
        client = httpx.Client(base_url=server.url, timeout=30.0)
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close()
    for server in servers:
        server.stop()


@pytest.fixture
def inst(serve: Callable[[InstanceConfig], httpx.Client]) -> httpx.Client:
    return serve(sim_config())


def trajectory(traj_id: str, max_tokens: int = 64, v_traj: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "traj_id": traj_id,
        "group_id": traj_id.split("/")[0],
        "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "v_traj": v_traj,
        "sampling": {"max_tokens": max_tokens},
        **extra,
    }


_ids = iter(range(10**9))


def command(client: httpx.Client, kind: str, command_id: str | None = None, **body: Any) -> httpx.Response:
    return client.post("/v1/commands", json={"command_id": command_id or f"c{next(_ids)}", "kind": kind, **body})


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def advance(client: httpx.Client, **body: Any) -> dict[str, Any]:
    return ok(client.post("/v1/sim/advance", json=body))


def snapshot(client: httpx.Client) -> dict[str, Any]:
    return ok(client.get("/v1/snapshot"))


def reference_tokens(traj_id: str, max_tokens: int = 64) -> tuple[int, ...]:
    core = SimCore(SimParams(workload=preset("ci-tiny", 3)))
    core.route([TrajectoryRequest(traj_id=traj_id, group_id=traj_id.split("/")[0], prompt_ids=tuple(range(1, 9)),
                                  v_traj=0, sampling=SamplingParams(max_tokens=max_tokens))])
    while (t := core.next_event_time()) is not None:
        core.advance_to(t)
    return core.pop_finished()[0].trajectory().tokens


# ------------------------------------------------------------------------------ the command cycle


def test_route_snapshot_and_completed_feed(inst: httpx.Client) -> None:
    assert ok(inst.get("/v1/health"))["status"] == "ok"
    reply = ok(command(inst, "route", trajectories=[trajectory("g/0"), trajectory("g/1")]))
    assert reply["seq"] == 1 and reply["routed"] == ["g/0", "g/1"]
    snap = snapshot(inst)
    assert snap["instance_id"] == "inst-0" and snap["seq"] == 1 and snap["inst_version"] == 0
    assert snap["run_trajs"] == ["g/0", "g/1"] and snap["wait_trajs"] == [] and snap["complete_trajs"] == []
    assert snap["engine_time"] == 0.0 and snap["timestamp"] > 0

    advance(inst, by=0.05)
    later = snapshot(inst)
    assert later["kv_cache"] > snap["kv_cache"] and later["engine_time"] == pytest.approx(0.05)
    assert later["decode_steps"] > snap["decode_steps"] == 0 and later["decode_seconds"] > 0, "the decode counters"

    done = advance(inst, until_idle=True)
    assert done["completed_seq"] == 2
    feed = ok(inst.get("/v1/completed", params={"after": 0}))
    items = feed["items"]
    assert [i["seq"] for i in items] == [1, 2] and feed["next_after"] == 2
    by_id = {i["trajectory"]["traj_id"]: i["trajectory"] for i in items}
    assert set(by_id) == {"g/0", "g/1"} and all(i["instance_id"] == "inst-0" for i in items)
    g0 = by_id["g/0"]
    assert tuple(g0["tokens"]) == reference_tokens("g/0")
    assert len(g0["logprobs"]) == len(g0["tokens"]) and g0["finish_reason"] in ("stop", "length")
    assert g0["segments"] == [{"version": 0, "start": 0, "end": len(g0["tokens"])}]
    assert sorted(snapshot(inst)["complete_trajs"]) == ["g/0", "g/1"]

    # reading acknowledges nothing; an acknowledgement (a POST) releases what it names
    assert ok(inst.get("/v1/completed", params={"after": 2}))["oldest_seq"] == 1
    assert ok(inst.post("/v1/completed/ack", json={"seqs": [1, 2, 7]})) == {"acknowledged": [1, 2], "ignored": [7]}
    feed = ok(inst.get("/v1/completed", params={"after": 0}))
    assert feed["items"] == [] and feed["oldest_seq"] is None
    assert ok(inst.get("/v1/health"))["outbox"] == {"last_seq": 2, "acked": 2, "pending": 0, "dropped": 0}


def test_interrupt_returns_partials_that_resume_on_another_instance(serve: Callable[[InstanceConfig], httpx.Client]) -> None:
    old = serve(sim_config("old"))
    new = serve(sim_config("new", initial_version=4))
    ok(command(old, "route", trajectories=[trajectory("m/0")]))
    advance(old, by=0.1)
    reply = ok(command(old, "interrupt", traj_ids=["m/0", "ghost"]))
    assert reply["not_found"] == ["ghost"]
    (partial,) = reply["partials"]
    k = len(partial["tokens"])
    assert 0 < k < 64 and partial["segments"] == [{"version": 0, "start": 0, "end": k}]
    assert snapshot(old)["run_trajs"] == []

    ok(command(new, "route", trajectories=[partial]))  # a partial is routed back verbatim
    advance(new, until_idle=True)
    (item,) = ok(new.get("/v1/completed"))["items"]
    resumed = item["trajectory"]
    assert tuple(resumed["tokens"]) == reference_tokens("m/0")
    assert resumed["segments"] == [{"version": 0, "start": 0, "end": k},
                                   {"version": 4, "start": k, "end": len(resumed["tokens"])}]


def test_abort_and_pull(inst: httpx.Client) -> None:
    ok(command(inst, "route", trajectories=[trajectory(f"p/{i}") for i in range(3)]))
    advance(inst, by=0.05)
    reply = ok(command(inst, "abort", traj_ids=["p/0", "nope"]))
    assert reply["aborted"] == ["p/0"] and reply["not_found"] == ["nope"]
    advance(inst, by=0.0)
    (aborted,) = ok(inst.get("/v1/completed"))["items"]
    assert aborted["trajectory"]["traj_id"] == "p/0" and aborted["trajectory"]["finish_reason"] == "abort"

    reply = ok(command(inst, "pull", version=2, weights={"source": "sim", "size_bytes": 10**9}))
    assert reply["version"] == 2 and sorted(p["traj_id"] for p in reply["partials"]) == ["p/1", "p/2"]
    snap = snapshot(inst)
    assert (snap["run_trajs"], snap["wait_trajs"], snap["complete_trajs"]) == ([], [], [])
    assert snap["inst_version"] == 2 and snap["loading_weights"] is True

    # routed during the Pull: waits, then runs on the new version
    ok(command(inst, "route", trajectories=[trajectory("p/3", v_traj=2)]))
    assert snapshot(inst)["wait_trajs"] == ["p/3"]
    advance(inst, until_idle=True)
    snap = snapshot(inst)
    assert snap["loading_weights"] is False and snap["complete_trajs"] == ["p/3"]
    assert snap["seq"] == 4


# ------------------------------------------------------------------------------ idempotency and ordering


def test_retried_commands_replay_and_reused_ids_are_refused(inst: httpx.Client) -> None:
    body = {"trajectories": [trajectory("r/0")]}
    first = command(inst, "route", command_id="route-1", **body)
    again = command(inst, "route", command_id="route-1", **body)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json() and again.headers["idempotent-replay"] == "true"
    assert "idempotent-replay" not in first.headers
    assert snapshot(inst)["seq"] == 1 and snapshot(inst)["run_trajs"] == ["r/0"]  # applied once

    clash = command(inst, "route", command_id="route-1", trajectories=[trajectory("r/1")])
    assert clash.status_code == 409 and clash.json()["code"] == "command_id_reused"

    interrupted = ok(command(inst, "interrupt", command_id="int-1", traj_ids=["r/0"]))
    replay = ok(command(inst, "interrupt", command_id="int-1", traj_ids=["r/0"]))
    assert replay == interrupted and len(replay["partials"]) == 1  # the partial is not lost on retry

    # a refused command is answered the same way on retry, and takes no sequence number
    dup = [trajectory("r/2"), trajectory("r/2")]
    refused = command(inst, "route", command_id="dup", trajectories=dup)
    assert refused.status_code == 409 and refused.json()["code"] == "duplicate_trajectory"
    assert command(inst, "route", command_id="dup", trajectories=dup).json() == refused.json()
    assert snapshot(inst)["seq"] == 2


def test_concurrent_commands_get_distinct_ordered_sequence_numbers(inst: httpx.Client) -> None:
    def route(i: int) -> int:
        return ok(command(inst, "route", command_id=f"par-{i}", trajectories=[trajectory(f"c/{i}")]))["seq"]

    with ThreadPoolExecutor(8) as pool:
        seqs = list(pool.map(route, range(24)))
    assert sorted(seqs) == list(range(1, 25))
    snap = snapshot(inst)
    assert snap["seq"] == 24
    # the engine saw them in sequence order: its FIFO queue lists them by seq
    order = [f"c/{i}" for _, i in sorted(zip(seqs, range(24), strict=True))]
    assert snap["run_trajs"] + snap["wait_trajs"] == order


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "payload, status, code, mentions",
    [
        ({"command_id": "a", "kind": "route", "trajectories": [trajectory("x", v_traj=None)]}, 422, "invalid_request",
         "v_traj"),
        ({"command_id": "b", "kind": "teleport"}, 422, "invalid_request", "kind"),
        ({"command_id": "b2", "kind": "route", "trajectories": [trajectory("x", prompt_ids=[-1])]}, 422,
         "invalid_request", "prompt_ids"),
        ({"command_id": "c", "kind": "route", "trajectories": []}, 422, "invalid_request", "trajectories"),
        ({"command_id": "d", "kind": "interrupt"}, 422, "invalid_request", "traj_ids"),
        ({"command_id": "e", "kind": "pull", "version": -1}, 422, "invalid_request", "version"),
        ({"kind": "abort", "traj_ids": ["x"]}, 422, "invalid_request", "command_id"),
        ({"command_id": "f", "kind": "route", "trajectories": [trajectory("x", tokens=[1, 2], logprobs=[-1.0])]},
         422, "invalid_trajectory", "logprobs"),
        ({"command_id": "g", "kind": "route", "trajectories": [trajectory("x", v_traj=3)]}, 409, "version_too_new",
         "v_traj"),
        ({"command_id": "h", "kind": "route", "trajectories": [trajectory("x", max_tokens=10**9)]}, 422,
         "exceeds_kv_budget", "KV budget"),
        ({"command_id": "i", "kind": "pull", "version": 1, "weights": {"source": "path", "path": "/w"}}, 422,
         "invalid_weights", "SimWeights"),
        ({"command_id": "j", "kind": "pull", "version": 1, "weights": {"source": "bytes", "data_b64": "%%%"}}, 422,
         "invalid_weights", "base64"),
        ([1, 2, 3], 422, "invalid_request", "dictionary"),
    ],
)
def test_bad_commands_are_4xx_with_a_reason(inst: httpx.Client, payload: Any, status: int, code: str, mentions: str) -> None:
    reply = inst.post("/v1/commands", json=payload)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["code"] == code and mentions in error["detail"]
    assert snapshot(inst)["seq"] == 0


def test_other_bad_requests_are_4xx(inst: httpx.Client) -> None:
    not_json = inst.post("/v1/commands", content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["code"] == "invalid_request"
    assert inst.get("/v1/completed", params={"limit": 0}).status_code == 422
    assert inst.get("/v1/completed", params={"after": -1}).status_code == 422
    both = inst.post("/v1/sim/advance", json={"to": 1.0, "by": 1.0})
    assert both.status_code == 422 and "exactly one" in both.json()["detail"]
    advance(inst, to=2.0)
    back = inst.post("/v1/sim/advance", json={"to": 1.0})
    assert back.status_code == 409 and back.json()["code"] == "time_backwards"
    ok(command(inst, "pull", version=3))
    regress = command(inst, "pull", version=2)
    assert regress.status_code == 409 and regress.json()["code"] == "version_regression"


# ------------------------------------------------------------------------------ delivery


def test_long_poll_returns_when_a_trajectory_completes(inst: httpx.Client) -> None:
    ok(command(inst, "route", trajectories=[trajectory("lp/0")]))
    result: dict[str, Any] = {}

    def poll() -> None:
        with httpx.Client(base_url=str(inst.base_url), timeout=30.0) as other:
            result["reply"] = ok(other.get("/v1/completed", params={"after": 0, "wait_s": 20}))

    poller = threading.Thread(target=poll)
    started = time.monotonic()
    poller.start()
    advance(inst, until_idle=True)
    poller.join(25)
    assert [i["trajectory"]["traj_id"] for i in result["reply"]["items"]] == ["lp/0"]
    assert time.monotonic() - started < 15
    empty = ok(inst.get("/v1/completed", params={"after": 1, "wait_s": 0.05}))
    assert empty["items"] == [] and empty["last_seq"] == 1


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_completions_are_pushed_to_the_callback_with_retry(serve: Callable[[InstanceConfig], httpx.Client]) -> None:
    received: list[dict[str, Any]] = []
    refusals = {"left": 1}
    receiver = FastAPI()

    @receiver.post("/completed")
    async def collect(request: Request) -> JSONResponse:
        if refusals["left"]:
            refusals["left"] -= 1
            return JSONResponse({"busy": True}, status_code=503)
        received.extend((await request.json())["items"])
        return JSONResponse({"ok": True})

    with serve_in_thread(receiver) as sink:
        config = sim_config("pusher").model_copy(update={"completion_callback_url": f"{sink.url}/completed"})
        inst = serve(config)
        ok(command(inst, "route", trajectories=[trajectory(f"cb/{i}") for i in range(4)]))
        advance(inst, until_idle=True)
        wait_until(lambda: len(received) >= 4)
    assert refusals["left"] == 0  # the first delivery failed and was retried
    assert [i["seq"] for i in received] == [1, 2, 3, 4]
    assert {i["trajectory"]["traj_id"] for i in received} == {f"cb/{i}" for i in range(4)}
    assert ok(inst.get("/v1/health"))["callback"]["delivered_seq"] == 4


def test_a_read_of_the_feed_acknowledges_nothing_and_an_ack_only_what_was_handed_out(inst: httpx.Client) -> None:
    ok(command(inst, "route", trajectories=[trajectory(f"ro/{i}") for i in range(3)]))
    advance(inst, until_idle=True)
    for _ in range(5):  # what an unauthenticated client can do: read far past the newest item
        huge = ok(inst.get("/v1/completed", params={"after": 10**12, "limit": 1}))
        assert huge["items"] == [] and huge["last_seq"] == 3
    assert ok(inst.get("/v1/health"))["outbox"] == {"last_seq": 3, "acked": 0, "pending": 3, "dropped": 0}
    first = ok(inst.get("/v1/completed", params={"after": 0, "limit": 1}))["items"]
    assert [i["seq"] for i in first] == [1]
    # seq 2 and 3 were never handed out: acknowledging them changes nothing
    assert ok(inst.post("/v1/completed/ack", json={"seqs": [1, 2, 3]})) == {"acknowledged": [1], "ignored": [2, 3]}
    rest = ok(inst.get("/v1/completed", params={"after": 0}))["items"]
    assert sorted(i["trajectory"]["traj_id"] for i in rest + first) == ["ro/0", "ro/1", "ro/2"]
    assert [i["seq"] for i in rest] == [2, 3]
    for bad in ({"seqs": []}, {"seqs": [0]}, {"seqs": "1"}, {"through": 3}):
        assert inst.post("/v1/completed/ack", json=bad).status_code == 422, bad


def test_reads_of_the_feed_do_not_lose_completions_or_stop_the_callback(
        serve: Callable[[InstanceConfig], httpx.Client]) -> None:
    """Reading the feed far past its newest item (once, this acknowledged everything, undelivered
    completions included, and left the callback spinning without yielding the event loop)."""
    received: list[dict[str, Any]] = []
    gate = threading.Event()
    receiver = FastAPI()

    @receiver.post("/completed")
    async def collect(request: Request) -> JSONResponse:
        if not gate.is_set():
            return JSONResponse({"detail": "restarting", "code": "store_unavailable"}, status_code=503)
        received.extend((await request.json())["items"])
        return JSONResponse({"accepted": 1})

    with serve_in_thread(receiver) as sink:
        inst = serve(sim_config("reader").model_copy(update={"completion_callback_url": f"{sink.url}/completed"}))
        ok(command(inst, "route", trajectories=[trajectory(f"lost/{i}") for i in range(4)]))
        advance(inst, until_idle=True)
        for _ in range(20):
            ok(inst.get("/v1/completed", params={"after": 10**12, "limit": 1}))
        assert ok(inst.get("/v1/health"))["outbox"]["pending"] == 4  # nothing was dropped by reading
        gate.set()
        wait_until(lambda: len(received) >= 4)
        ok(command(inst, "route", trajectories=[trajectory("lost/after")]))  # the instance still serves
        advance(inst, until_idle=True)
        wait_until(lambda: len(received) >= 5)
    assert sorted(i["trajectory"]["traj_id"] for i in received) == sorted([f"lost/{i}" for i in range(4)] + ["lost/after"])
    assert ok(inst.get("/v1/health"))["outbox"] == {"last_seq": 5, "acked": 5, "pending": 0, "dropped": 0}


@pytest.mark.parametrize(("status", "tries"), [(422, 1), (500, CALLBACK_ERROR_ATTEMPTS)])
def test_the_callback_drops_a_refused_batch_instead_of_retrying_it_forever(
        serve: Callable[[InstanceConfig], httpx.Client], status: int, tries: int) -> None:
    """A 4xx is final; another server error (not 502/503/504: the receiver restarting) is tried a
    few times. Either way the batch is dropped and later ones still go out."""
    calls: list[list[str]] = []
    receiver = FastAPI()

    @receiver.post("/completed")
    async def refuse_the_first(request: Request) -> JSONResponse:
        ids = [i["trajectory"]["traj_id"] for i in (await request.json())["items"]]
        calls.append(ids)
        if "bad/0" in ids:
            return JSONResponse({"detail": "refused", "code": "invalid_request"}, status_code=status)
        return JSONResponse({"accepted": len(ids)})

    with serve_in_thread(receiver) as sink:
        inst = serve(sim_config("refused").model_copy(update={"completion_callback_url": f"{sink.url}/completed"}))
        ok(command(inst, "route", trajectories=[trajectory("bad/0")]))
        advance(inst, until_idle=True)
        wait_until(lambda: ok(inst.get("/v1/health"))["callback"]["delivered_seq"] == 1)
        ok(command(inst, "route", trajectories=[trajectory("good/0")]))
        advance(inst, until_idle=True)
        wait_until(lambda: ["good/0"] in calls)
    assert calls == [["bad/0"]] * tries + [["good/0"]]
    assert ok(inst.get("/v1/health"))["outbox"]["pending"] == 0


def test_acknowledging_needs_the_token() -> None:
    with serve_in_thread(create_app(sim_config("guarded")), token="s3cret") as server, \
            httpx.Client(base_url=server.url, timeout=30.0) as anyone, \
            httpx.Client(base_url=server.url, timeout=30.0, headers={"Authorization": "Bearer s3cret"}) as owner:
        ok(command(owner, "route", trajectories=[trajectory("tok/0")]))
        advance(owner, until_idle=True)
        (item,) = ok(anyone.get("/v1/completed"))["items"]  # reads stay open
        assert anyone.post("/v1/completed/ack", json={"seqs": [item["seq"]]}).status_code == 401
        assert len(ok(anyone.get("/v1/completed"))["items"]) == 1, "a refused acknowledgement changes nothing"
        assert ok(owner.post("/v1/completed/ack", json={"seqs": [item["seq"]]})) == {"acknowledged": [item["seq"]],
                                                                                     "ignored": []}


def test_real_clock_instance_completes_on_its_own(serve: Callable[[InstanceConfig], httpx.Client]) -> None:
    inst = serve(sim_config("live", clock="real", speed=200.0))
    ok(command(inst, "route", trajectories=[trajectory("rt/0", max_tokens=16)]))
    reply = ok(inst.get("/v1/completed", params={"after": 0, "wait_s": 20}))
    assert [i["trajectory"]["traj_id"] for i in reply["items"]] == ["rt/0"]
    not_virtual = inst.post("/v1/sim/advance", json={"until_idle": True})
    assert not_virtual.status_code == 409 and not_virtual.json()["code"] == "wrong_clock"


# ------------------------------------------------------------------------------ configuration and CLI


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    cases = [
        ({"instance_id": "a", "engine": "vllm"}, "vllm"),
        ({"instance_id": "bad id!"}, "instance_id"),
        ({"instance_id": "a", "sim": {"workload": "huge"}}, "sim.workload"),
        ({"instance_id": "a", "sim": {"kv_budget": 0}}, "sim.kv_budget"),
        ({"instance_id": "a", "sim": {"clock": "sundial"}}, "sim.clock"),
        ({"instance_id": "a", "port": 70000}, "port"),
        ({"instance_id": "a", "surprise": 1}, "surprise"),
    ]
    for data, field in cases:
        with pytest.raises(ValidationError) as err:
            InstanceConfig.model_validate(data)
        locs = {".".join(str(p) for p in e["loc"]) for e in err.value.errors()}
        assert field in locs or field in str(err.value), (data, locs)

    file = tmp_path / "inst.yaml"
    file.write_text("instance_id: from-file\nsim:\n  workload: ci-tiny\n  seed: 4\n")
    config = build_config(config_file=file, engine=None, instance_id=None, host=None, port=9001,
                          sim_options={"seed": 5}, vllm_options={}, callback_url=None)
    assert (config.instance_id, config.port, config.sim.workload, config.sim.seed) == ("from-file", 9001, "ci-tiny", 5)


def test_cli_registers_the_instance_command_and_rejects_bad_options() -> None:
    app, serve_group = typer.Typer(), typer.Typer()
    app.add_typer(serve_group, name="serve")
    register(serve_group)

    @app.callback()
    def main() -> None:
        pass

    runner = CliRunner()
    help_text = runner.invoke(app, ["serve", "instance", "--help"]).output
    assert "--engine" in help_text and "--instance-id" in help_text and "--sim-set" in help_text
    bad = runner.invoke(app, ["serve", "instance", "--instance-id", "x", "--sim-set", "noise=-1"])
    assert bad.exit_code == 2 and "sim.noise" in bad.output
    bad = runner.invoke(app, ["serve", "instance", "--instance-id", "x", "--sim-set", "noise"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
