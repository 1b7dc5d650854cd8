"""The parameter-server relay: a parameter server on a rollout machine mirroring the job's one, so
a version crosses the network once per machine; instances there pull it over shared memory."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from staleflow.coordinator.app import CoordinatorConfig, InstanceEndpoint
from staleflow.coordinator.app import create_app as coordinator_app
from staleflow.servers.http import serve_in_thread
from staleflow.servers.params import ParamsConfig, create_app
from staleflow.servers.params.relay import Mirror
from staleflow.transports.client import ParamsClient, RawTensor


def weights(version: int) -> dict[str, object]:
    rng = np.random.default_rng(version)
    return {"embed.weight": rng.standard_normal((256, 64)).astype(np.float32),
            "layers.0.bias": rng.standard_normal(33).astype(np.float16),
            "bf16": RawTensor("BF16", (3, 5), rng.integers(0, 2**16, 15, dtype=np.uint16).tobytes())}


def same(pulled: dict, pushed: dict) -> bool:
    return set(pulled) == set(pushed) and all(
        pulled[k].tobytes() == (v.data if isinstance(v, RawTensor) else v.tobytes()) for k, v in pushed.items())


def server(path: Path):
    return serve_in_thread(create_app(ParamsConfig(state_dir=path, port=0, fsync=False, keep=3)))


def test_a_relay_copies_each_version_once_and_serves_it_over_shm(tmp_path: Path) -> None:
    with server(tmp_path / "upstream") as up, server(tmp_path / "relay") as relay, \
            ParamsClient(up.url) as upstream, ParamsClient(relay.url) as local:
        for v in (0, 1):
            upstream.push(v, weights(v))
        mirror = Mirror(up.url, relay.url, threading.Event())
        assert mirror.sync(upstream, local) == [0, 1]
        assert mirror.sync(upstream, local) == [], "a version already held is not copied again"
        assert same(local.pull(1, "shm"), weights(1)), "byte-exact through the relay, over shared memory"

        # an instance told to pull a version the relay is still copying waits for it
        pulled: dict = {}
        waiting = threading.Thread(target=lambda: pulled.update(local.pull(2, "http", wait_s=60)))
        waiting.start()
        upstream.push(2, weights(2))
        assert mirror.sync(upstream, local) == [2]
        waiting.join(60)
        assert same(pulled, weights(2))


def test_each_instance_pull_names_its_own_parameter_server() -> None:
    config = CoordinatorConfig(ts_url="http://127.0.0.1:9", params_url="http://10.0.0.1:8331", instances=[
        InstanceEndpoint(instance_id="inst-0", url="http://10.0.0.2:8341", params_url="http://10.0.0.2:8350"),
        InstanceEndpoint(instance_id="inst-1", url="http://10.0.0.3:8341")])
    with TestClient(coordinator_app(config)) as client:
        listed = {i["instance_id"]: i["params_url"] for i in client.get("/v1/instances").json()["instances"]}
        assert listed == {"inst-0": "http://10.0.0.2:8350", "inst-1": "http://10.0.0.1:8331"}
        moved = client.put("/v1/instances/inst-1", json={"instance_id": "inst-1", "url": "http://10.0.0.4:8341",
                                                         "params_url": "http://10.0.0.4:8350"})
        assert moved.status_code == 200 and moved.json()["url"] == "http://10.0.0.4:8341"
        assert moved.json()["params_url"] == "http://10.0.0.4:8350"
