"""Every served component refuses request bodies over its limit with 413 and a reason, whether the
body declares its length or streams it chunked; PS chunk uploads are bounded per chunk instead."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from support import manager_config

from staleflow.config import LedgerConfig
from staleflow.coordinator.app import CoordinatorConfig
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import MAX_BODY_ENV, max_body_bytes, serve_in_thread
from staleflow.servers.instance import InstanceConfig, SimConfig
from staleflow.servers.instance import create_app as instance_app
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.params import ParamsConfig
from staleflow.servers.params import create_app as params_app
from staleflow.servers.reward import RewardConfig
from staleflow.servers.reward import create_app as reward_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

LIMIT = 4096
TOO_BIG = b'{"x": "' + b"a" * (4 * LIMIT) + b'"}'

CHUNK_UPLOAD = "/v1/params/{version}/chunks/{index}"
UNDECLARED = {"instance": [("POST", "/v1/commands")]}  # reads its body itself (one schema per command kind)


def uploads(url: str) -> list[tuple[str, str]]:
    """Every operation of the service's OpenAPI schema that takes a request body."""
    import re

    schema = httpx.get(f"{url}/openapi.json").json()
    return [(method.upper(), re.sub(r"\{[^}]+\}", "1", path))
            for path, item in schema["paths"].items() for method, op in item.items()
            if "requestBody" in op and path != CHUNK_UPLOAD]


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp: Path = tmp_path_factory.mktemp("limits")
    with ExitStack() as stack:
        def serve(app):
            return stack.enter_context(serve_in_thread(app, body_limit=LIMIT)).url

        urls = {"manager": serve(manager_app(manager_config(tmp, eta=1, batch_size=2)))}
        urls["ts"] = serve(ts_app(TrajectoryServerConfig(
            ledger=LedgerConfig(eta=1, batch_size=2, group_size=1), manager_url=urls["manager"], state_dir=tmp,
            reward="sim", sampling=SamplingConfig(max_tokens=16))))
        urls["instance"] = serve(instance_app(InstanceConfig(instance_id="i", sim=SimConfig(workload="ci-tiny"))))
        urls["coordinator"] = serve(coordinator_app(CoordinatorConfig(manager_url=urls["manager"], ts_url=urls["ts"])))
        urls["reward"] = serve(reward_app(RewardConfig(workers=1)))
        urls["params"] = serve(params_app(ParamsConfig(state_dir=tmp / "params", chunk_bytes=LIMIT * 4, fsync=False)))
        yield urls


def _chunks() -> Iterator[bytes]:
    for i in range(0, len(TOO_BIG), 1000):
        yield TOO_BIG[i:i + 1000]


@pytest.mark.parametrize("service", ["manager", "ts", "instance", "coordinator", "reward", "params"])
def test_oversized_bodies_get_413_with_the_limit_and_the_fix(services: dict[str, str], service: str) -> None:
    operations = uploads(services[service]) + UNDECLARED.get(service, [])
    assert operations, f"{service} has no upload endpoint?"
    for method, path in operations:
        _refused(services[service], method, path)
    expected = {"ts": {"/v1/completed", "/v1/return", "/v1/checkout"}, "instance": {"/v1/commands"},
                "manager": {"/v1/reservations"}, "reward": {"/v1/rewards"}, "coordinator": {"/v1/instances"}}
    assert expected.get(service, set()) <= {path for _, path in operations}


def _refused(url: str, method: str, path: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        declared = client.request(method, path, content=TOO_BIG, headers={"content-type": "application/json"})
        assert declared.status_code == 413, (method, path, declared.text)
        reason = declared.json()["detail"]
        assert str(LIMIT) in reason and MAX_BODY_ENV in reason and path in reason
        # no Content-Length: a chunked body is counted as it arrives
        streamed = client.request(method, path, content=_chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413, (method, path, streamed.text)
        assert MAX_BODY_ENV in streamed.json()["detail"]


def test_bodies_within_the_limit_still_work_streamed_or_not(services: dict[str, str]) -> None:
    import json

    body = json.dumps({"group_id": "small", "v_traj": 0}).encode()
    with httpx.Client(base_url=services["manager"], timeout=30) as client:
        assert client.post("/v1/reservations", content=body, headers={"content-type": "application/json"}).status_code == 201
        streamed = client.post("/v1/reservations", content=iter([body[:10], body[10:].replace(b"small", b"other")]),
                               headers={"content-type": "application/json"})
        assert streamed.status_code == 201, streamed.text
        buffers = client.get("/v1/buffers").json()["buffers"]
        assert {e["group_id"] for b in buffers for e in b["entries"]} == {"small", "other"}


def test_ps_chunk_uploads_are_bounded_per_chunk_not_by_the_body_limit(services: dict[str, str]) -> None:
    chunk = LIMIT * 3  # over the general limit, within the PS's chunk size
    with httpx.Client(base_url=services["params"], timeout=30) as client:
        push = client.post("/v1/params/1", json={"tensors": [{"name": "w", "dtype": "U8", "shape": [chunk]}]})
        assert push.status_code == 201, push.text
        import zlib

        data = b"\0" * chunk
        put = client.put("/v1/params/1/chunks/0", params={"push_id": push.json()["push_id"]}, content=data,
                         headers={"x-staleflow-checksum": f"crc32:{zlib.crc32(data):08x}"})
        assert put.status_code < 300, put.text


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BODY_ENV, "12345")
    assert max_body_bytes() == 12345 and max_body_bytes(7) == 7
    monkeypatch.setenv(MAX_BODY_ENV, "lots")
    assert max_body_bytes() > 1 << 20, "a malformed value falls back to the default (with a warning)"
