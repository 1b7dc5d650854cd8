"""The trajectory server end to end over real HTTP on loopback: TS -> instance (sim) -> reward
-> ledger occupy -> consume -> trainer fetch, with the payload intact."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from support import manager_config, train_buffer_zero

from staleflow.api.base import http_client
from staleflow.api.manager import ManagerClient
from staleflow.config import LedgerConfig
from staleflow.servers.http import serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app
from staleflow.training.role import StepLog, TrainerLoop
from staleflow.training.simulated import SimulatedBackend
from staleflow.transports.client import ParamsClient

GROUP = 2


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll a real condition (callbacks arrive asynchronously) with a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


class Cluster:
    def __init__(self, tmp_path: Path, stack: ExitStack, db_url: str | None = None, vocab_size: int | None = None):
        mcfg = manager_config(tmp_path, db_url, eta=1, batch_size=2, group_size=GROUP)
        self.manager_url = stack.enter_context(serve_in_thread(manager_app(mcfg))).url
        self.ts_config = TrajectoryServerConfig(
            ledger=LedgerConfig(eta=1, batch_size=2, group_size=GROUP), manager_url=self.manager_url,
            state_dir=tmp_path, db_url=db_url, reward="sim", sampling=SamplingConfig(max_tokens=64),
            vocab_size=vocab_size,
        )
        self.ts_server = stack.enter_context(serve_in_thread(ts_app(self.ts_config)))
        self.ts_url = self.ts_server.url
        self.ts = stack.enter_context(http_client(self.ts_url))
        self.manager = stack.enter_context(ManagerClient(self.manager_url))
        self.instances: dict[str, httpx.Client] = {}
        for name in ("a", "b"):
            cfg = InstanceConfig(instance_id=name, sim=SimConfig(workload="ci-tiny"),
                                 completion_callback_url=f"{self.ts_url}/v1/completed")
            url = stack.enter_context(serve_in_thread(instance_app(cfg))).url
            self.instances[name] = stack.enter_context(http_client(url))
        self.commands = 0

    def command(self, instance: str, **body: object) -> dict:
        self.commands += 1
        reply = self.instances[instance].post("/v1/commands", json={"command_id": f"c{self.commands}", **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def route(self, instance: str, traj_ids: list[str], v_traj: int) -> list[dict]:
        reply = self.ts.post("/v1/checkout", json={"instance_id": instance,
                                                   "assignments": [{"traj_id": t, "v_traj": v_traj} for t in traj_ids]})
        assert reply.status_code == 200 and not reply.json()["refused"], reply.text
        payloads = reply.json()["trajectories"]
        self.command(instance, kind="route", trajectories=payloads)
        return payloads

    def run_until_idle(self, instance: str) -> None:
        assert self.instances[instance].post("/v1/sim/advance", json={"until_idle": True}).status_code == 200

    def train_buffer_zero(self, keep: str | None = None) -> None:
        """Consume buffer 0 with two groups run on instance a: model version 1 may exist now."""
        def route_and_run(traj_ids: list[str]) -> None:
            self.route("a", traj_ids, v_traj=0)
            self.run_until_idle("a")
        train_buffer_zero(self.ts_url, self.manager_url, route_and_run, keep)


@pytest.fixture
def cluster(tmp_path: Path, db_url: str | None) -> Iterator[Cluster]:
    """Manager, TS and two sim instances; the ledger and the trajectory store on each database
    backend (on PostgreSQL both in one database, as in a cluster job)."""
    with ExitStack() as stack:
        c = Cluster(tmp_path, stack, db_url)
        c.manager.health()
        c.ts.get("/v1/health").raise_for_status()
        yield c


def test_prompts_flow_to_the_trainer_with_payload_intact(cluster: Cluster) -> None:
    pending = cluster.ts.get("/v1/pending").json()["trajectories"]
    # (eta + 1) x B groups of G members are kept in flight
    assert len(pending) == (1 + 1) * 2 * GROUP and all(p["v_traj"] is None for p in pending)
    groups: dict[str, list[str]] = {}
    for p in pending:
        groups.setdefault(p["group_id"], []).append(p["traj_id"])
    first_two = list(groups)[:2]
    for g in first_two:
        cluster.route("a", groups[g], v_traj=0)
    assert cluster.manager.buffers().buffers[1].entries, "routing reserved the groups in the ledger"
    cluster.run_until_idle("a")
    wait_for(lambda: all(
        cluster.ts.get(f"/v1/trajectories/{t}").json()["state"] == "rewarded" for g in first_two for t in groups[g]))
    wait_for(lambda: cluster.manager.buffers().buffers[0].state == "ready")
    consumed = cluster.manager.consume()
    assert sorted(consumed.group_ids) == sorted(first_two)
    batch = cluster.ts.get(f"/v1/batches/{consumed.version}").json()
    assert len(batch["trajectories"]) == 2 * GROUP
    for t in batch["trajectories"]:
        assert len(t["tokens"]) == len(t["logprobs"]) > 0
        assert t["segments"] == [{"version": 0, "start": 0, "end": len(t["tokens"])}]
        assert t["reward"] in (0.0, 1.0) and t["v_traj"] == 0 and t["finish_reason"] in ("stop", "length")
    assert cluster.ts.delete(f"/v1/batches/{consumed.version}").json()["freed_groups"] == 2
    refused = cluster.ts.get(f"/v1/batches/{consumed.version}")
    assert refused.status_code == 410 and refused.json()["code"] == "batch_freed", "a freed batch is never served empty"
    # freed groups are replaced by fresh prompts: the TS keeps (eta + 1) x B groups in flight
    wait_for(lambda: len(cluster.ts.get("/v1/pending").json()["trajectories"]) == 4 * GROUP)


def test_interrupt_and_reroute_keep_tokens_and_segments(cluster: Cluster) -> None:
    traj = cluster.ts.get("/v1/pending").json()["trajectories"][0]
    sibling = [p for p in cluster.ts.get("/v1/pending").json()["trajectories"]
               if p["group_id"] == traj["group_id"] and p["traj_id"] != traj["traj_id"]]
    cluster.route("a", [traj["traj_id"]], v_traj=0)
    cluster.instances["a"].post("/v1/sim/advance", json={"by": 0.2}).raise_for_status()
    partial = cluster.command("a", kind="interrupt", traj_ids=[traj["traj_id"]])["partials"][0]
    assert 0 < len(partial["tokens"]) < 64
    assert cluster.ts.post("/v1/return", json={"instance_id": "a", "partials": [partial]}).json()["outcome"] == {
        traj["traj_id"]: "pending"}
    stored = cluster.ts.get(f"/v1/trajectories/{traj['traj_id']}").json()
    assert stored["state"] == "pending" and stored["tokens"] == partial["tokens"] and stored["v_traj"] == 0
    cluster.train_buffer_zero(keep=traj["group_id"])
    # instance b runs version 1; the partial (V_traj 0) may resume there, re-prefilling its tokens
    cluster.command("b", kind="pull", version=1)
    cluster.route("b", [traj["traj_id"]] + [s["traj_id"] for s in sibling], v_traj=0)
    cluster.run_until_idle("b")
    wait_for(lambda: cluster.ts.get(f"/v1/trajectories/{traj['traj_id']}").json()["state"] == "rewarded")
    done = cluster.ts.get(f"/v1/trajectories/{traj['traj_id']}").json()
    assert done["tokens"][: len(partial["tokens"])] == partial["tokens"], "the resumed response extends the partial"
    cut = len(partial["tokens"])
    assert done["segments"] == [{"version": 0, "start": 0, "end": cut},
                                {"version": 1, "start": cut, "end": len(done["tokens"])}]


def test_checkout_refusals_are_explained(cluster: Cluster) -> None:
    pending = cluster.ts.get("/v1/pending").json()["trajectories"]
    reply = cluster.ts.post("/v1/checkout", json={"instance_id": "a", "assignments": [
        {"traj_id": "nope", "v_traj": 0}, {"traj_id": pending[0]["traj_id"], "v_traj": 5}]}).json()
    assert reply["trajectories"] == []
    reasons = {r["traj_id"]: r["reason"] for r in reply["refused"]}
    assert reasons["nope"] == "unknown trajectory"
    assert "newer than any model" in reasons[pending[0]["traj_id"]]
    assert cluster.ts.post("/v1/checkout", json={"instance_id": "a", "assignments": []}).status_code == 422


def test_trajectory_server_survives_a_restart(tmp_path: Path, db_url: str | None) -> None:
    with ExitStack() as stack:
        c = Cluster(tmp_path, stack, db_url)
        pending = c.ts.get("/v1/pending").json()["trajectories"]
        g = pending[0]["group_id"]
        c.route("a", [p["traj_id"] for p in pending if p["group_id"] == g], v_traj=0)
        c.run_until_idle("a")
        wait_for(lambda: c.manager.buffers().buffers[0].entries != [] and all(
            e.status == "occupied" for e in c.manager.buffers().buffers[0].entries))
        before = c.ts.get("/v1/trajectories", params={"limit": 1000}).json()
        ts_config, manager_url = c.ts_config, c.manager_url
        # restart only the TS, on the same state directory (and database): the old one is gone first
        c.ts_server.stop()
        with serve_in_thread(ts_app(ts_config)) as again, http_client(again.url) as ts:
            after = ts.get("/v1/trajectories", params={"limit": 1000}).json()
            assert after["counts"] == before["counts"]
            member = next(p["traj_id"] for p in pending if p["group_id"] == g)
            assert ts.get(f"/v1/trajectories/{member}").json()["tokens"], "tokens survived the restart"
        assert manager_url


@pytest.mark.parametrize("backend", ["math", "server"])
def test_rewards_come_from_the_math_verifier(tmp_path: Path, backend: str) -> None:
    """Completed responses are scored by the verifier: in process, or through the reward server."""
    import asyncio

    from staleflow.servers.reward import RewardConfig
    from staleflow.servers.reward import create_app as reward_app
    from staleflow.servers.trajectories import http_reward, local_math_reward

    batch = [("t1", "so the answer is \\boxed{42}", "42"), ("t2", "I think it is 41", "42"), ("t3", "no idea", "7")]
    if backend == "math":
        scores = asyncio.run(local_math_reward()(batch))
    else:
        with serve_in_thread(reward_app(RewardConfig())) as server:
            scores = asyncio.run(http_reward(server.url)(batch))
    assert [r for r, _ in scores] == [1.0, 0.0, 0.0]
    assert scores[0][1] == "correct" and scores[2][1] == "no_answer"


class KilledMidPush(Mapping):
    """Weights whose push dies on its first read, as a SIGKILL of the trainer during the push would."""

    def __getitem__(self, key: str) -> object:
        raise RuntimeError("killed")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("killed")

    def __len__(self) -> int:
        raise RuntimeError("killed")


class KilledWhilePushing(SimulatedBackend):
    """The simulated trainer, killed while it pushes version ``killed_at``."""

    def __init__(self, killed_at: int | None, stop: threading.Event):
        super().__init__(0.0, 0.0, 1024, 1.0, stop)
        self.killed_at = killed_at

    def weights(self, version: int) -> Mapping:
        return KilledMidPush() if version == self.killed_at else super().weights(version)


def test_a_stateless_trainer_frees_a_batch_only_once_the_version_it_produced_is_visible(
        cluster: Cluster, tmp_path: Path) -> None:
    pending = cluster.ts.get("/v1/pending").json()["trajectories"]
    for p in pending:  # fill buffers 0 and 1 (eta = 1: both at v_traj 0)
        cluster.route("a", [p["traj_id"]], v_traj=0)
    cluster.run_until_idle("a")
    wait_for(lambda: [b.state for b in cluster.manager.buffers().buffers[:2]] == ["ready", "ready"])
    params = ParamsConfig(state_dir=tmp_path / "params", port=0, fsync=False)
    with serve_in_thread(params_app(params)) as ps:
        urls = {"manager": cluster.manager_url, "ts": cluster.ts_url, "params": ps.url}
        log = StepLog(tmp_path / "steps.jsonl")
        stop = threading.Event()
        crashed = TrainerLoop(KilledWhilePushing(2, stop), steps=2, eta=1, urls=urls, step_log=log, stop=stop)
        with pytest.raises(RuntimeError, match="killed"):
            crashed.run()  # trained 0 (version 1 visible) and 1, then died pushing version 2
        assert cluster.ts.get("/v1/batches/0").json()["code"] == "batch_freed", "version 1 covers batch 0"
        kept = cluster.ts.get("/v1/batches/1")
        assert kept.status_code == 200 and all(t["tokens"] for t in kept.json()["trajectories"])
        TrainerLoop(KilledWhilePushing(None, stop), steps=2, eta=1, urls=urls, step_log=log, stop=stop).run()
        with ParamsClient(ps.url) as client:
            assert client.latest().version == 2
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [0, 1, 1], "the restarted trainer trained step 1 again"
    assert records[1]["response_tokens"] == records[2]["response_tokens"] > 0, "on the same batch"
    assert cluster.ts.get("/v1/batches/1").json()["code"] == "batch_freed", "version 2 covers batch 1"


def test_completions_out_of_bounds_are_refused_with_422_and_change_nothing(cluster: Cluster) -> None:
    """A token id beyond int32 (the storage type) once failed the store's write: 503, a reload
    of the whole store, and an instance retrying forever."""
    traj_id = cluster.ts.get("/v1/pending").json()["trajectories"][0]["traj_id"]
    checkout = cluster.ts.post("/v1/checkout", json={"instance_id": "a", "assignments": [{"traj_id": traj_id, "v_traj": 0}]})
    assert checkout.status_code == 200 and not checkout.json()["refused"]

    def completion(tokens: list[int], logprobs: list[float]) -> httpx.Response:
        item = {"seq": 1, "trajectory": {"traj_id": traj_id, "tokens": tokens, "logprobs": logprobs, "finish_reason": "stop",
                                         "segments": [{"version": 0, "start": 0, "end": len(tokens)}]}}
        return cluster.ts.post("/v1/completed", content=json.dumps({"instance_id": "a", "items": [item]}),
                               headers={"content-type": "application/json"})

    for tokens, logprobs, mentions in [([2**31], [-0.5], "less than or equal to 2147483647"),
                                       ([10**30], [-0.5], "less than or equal"), ([-1], [-0.5], "greater than"),
                                       ([7], [float("nan")], "finite"), ([7], [float("-inf")], "finite"),
                                       ([7], [0.25], "less than or equal to 0"), ([7], [-1e39], "greater than")]:
        refused = completion(tokens, logprobs)
        assert refused.status_code == 422, (tokens, logprobs, refused.text)
        assert refused.json()["code"] == "invalid_request" and mentions in refused.json()["detail"]
    detail = cluster.ts.get(f"/v1/trajectories/{traj_id}").json()
    assert (detail["state"], detail["instance_id"], detail["generated"]) == ("routed", "a", 0)
    assert cluster.ts.get("/v1/health").json()["status"] == "ok"
    accepted = completion([2**31 - 1, 0], [0.0, -3.0e38])  # the bounds themselves are fine
    assert accepted.status_code == 200 and accepted.json() == {"accepted": 1}
    assert cluster.ts.get(f"/v1/trajectories/{traj_id}").json()["tokens"] == [2**31 - 1, 0]


def test_token_ids_outside_the_models_vocabulary_are_refused_with_422_and_change_nothing(tmp_path: Path) -> None:
    """Where the job knows the model's vocabulary (the sim workload's here: ci-tiny's 512), every
    way an instance hands tokens over refuses an id at or above it, and keeps nothing of the request."""
    with ExitStack() as stack:
        cluster = Cluster(tmp_path, stack, vocab_size=512)
        first, second = [t["traj_id"] for t in cluster.ts.get("/v1/pending").json()["trajectories"][:2]]
        for traj_id in (first, second):
            checkout = cluster.ts.post("/v1/checkout", json={"instance_id": "a",
                                                             "assignments": [{"traj_id": traj_id, "v_traj": 0}]})
            assert checkout.status_code == 200 and not checkout.json()["refused"]

        def handed_over(route: str, tokens: list[int], traj_id: str = first) -> httpx.Response:
            segments = [{"version": 0, "start": 0, "end": len(tokens)}]
            trajectory = {"traj_id": traj_id, "tokens": tokens, "logprobs": [-0.5] * len(tokens), "segments": segments}
            body = {"/v1/completed": {"instance_id": "a", "items": [
                        {"seq": 1, "trajectory": {**trajectory, "finish_reason": "stop"}}]},
                    "/v1/progress": {"instance_id": "a", "trajectories": [{**trajectory, "start": 0}]},
                    "/v1/return": {"instance_id": "a", "partials": [trajectory]}}[route]
            return cluster.ts.post(route, json=body)

        for route in ("/v1/completed", "/v1/progress", "/v1/return"):
            refused = handed_over(route, [3, 512, 7])
            assert refused.status_code == 422, (route, refused.text)
            error = refused.json()
            assert error["code"] == "invalid_token" and error["vocab_size"] == 512 and error["traj_id"] == first
            assert "token id 512" in error["detail"] and "vocabulary of 512" in error["detail"]
        detail = cluster.ts.get(f"/v1/trajectories/{first}").json()
        assert (detail["state"], detail["instance_id"], detail["generated"]) == ("routed", "a", 0)

        assert handed_over("/v1/progress", [3, 511]).json() == {"stored": {first: 2}, "ignored": []}
        assert handed_over("/v1/return", [3, 511, 0], traj_id=second).json()["outcome"] == {second: "pending"}
        assert handed_over("/v1/completed", [3, 511, 0]).json() == {"accepted": 1}
        assert cluster.ts.get(f"/v1/trajectories/{first}").json()["tokens"] == [3, 511, 0]


def test_tokens_the_bound_forbids_are_refused_with_422_and_change_nothing(cluster: Cluster) -> None:
    """Completions and returned partials are held to the rule progress checkpoints keep: segments
    contiguous over the tokens, every version from the group's V_traj to the newest the trainer has
    produced (the ledger's train version), at most max_tokens (64 here)."""
    cluster.train_buffer_zero()
    traj_id = cluster.ts.get("/v1/pending").json()["trajectories"][0]["traj_id"]
    checkout = cluster.ts.post("/v1/checkout", json={"instance_id": "b", "assignments": [{"traj_id": traj_id, "v_traj": 1}]})
    assert checkout.status_code == 200 and not checkout.json()["refused"], checkout.text

    def handed_over(route: str, segments: list[tuple[int, int, int]], tokens: int | None = None) -> httpx.Response:
        n = tokens if tokens is not None else max((end for _, _, end in segments), default=0)
        trajectory = {"traj_id": traj_id, "tokens": [5] * n, "logprobs": [-0.5] * n,
                      "segments": [{"version": v, "start": s, "end": e} for v, s, e in segments]}
        body = {"/v1/completed": {"instance_id": "b", "items": [{"seq": 1, "trajectory": {**trajectory,
                                                                                       "finish_reason": "stop"}}]},
                "/v1/return": {"instance_id": "b", "partials": [trajectory]}}[route]
        return cluster.ts.post(route, json=body)

    hostile = [([(0, 0, 4)], None, "stale_segment", "older than the group's V_traj 1"),
               ([(1, 0, 2), (0, 2, 4)], None, "stale_segment", "version 0"),
               ([(1, 0, 2), (2, 2, 4)], None, "unpublished_version", "version 2"),
               ([(1, 0, 2), (10**9, 2, 4)], None, "unpublished_version", "newer than any"),
               ([(1, 0, 2), (1, 3, 4)], None, "invalid_segments", "contiguous"),
               ([(1, 0, 3), (1, 2, 4)], None, "invalid_segments", "contiguous"),
               ([(1, 2, 4), (1, 0, 2)], 4, "invalid_segments", "contiguous"),
               ([(1, 0, 65)], None, "too_many_tokens", "max_tokens 64")]
    for route in ("/v1/completed", "/v1/return"):
        for segments, tokens, code, mentions in hostile:
            refused = handed_over(route, segments, tokens)
            assert refused.status_code == 422, (route, segments, refused.text)
            error = refused.json()
            assert error["code"] == code and error["traj_id"] == traj_id and mentions in error["detail"], error
            detail = cluster.ts.get(f"/v1/trajectories/{traj_id}").json()
            assert (detail["state"], detail["instance_id"], detail["generated"]) == ("routed", "b", 0)
    assert handed_over("/v1/return", [(1, 0, 3)]).json()["outcome"] == {traj_id: "pending"}
    assert cluster.ts.post("/v1/checkout", json={"instance_id": "b", "assignments": [
        {"traj_id": traj_id, "v_traj": 1}]}).json()["refused"] == []
    assert handed_over("/v1/completed", [(1, 0, 3), (1, 3, 64)]).json() == {"accepted": 1}
    assert cluster.ts.get(f"/v1/trajectories/{traj_id}").json()["generated"] == 64
