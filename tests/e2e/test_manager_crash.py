"""SIGKILL the staleness manager mid-stream: every acknowledged transition survives, nothing
half-applied appears."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
from support import free_port, start_cli

from staleflow.servers.clients import ManagerClient, ServiceError

ETA, BATCH = 2, 8


def start_manager(state_dir: Path, port: int) -> subprocess.Popen:
    return start_cli("serve", "manager", "--eta", str(ETA), "--batch-size", str(BATCH), "--group-size", "1",
                     "--state-dir", str(state_dir), "--port", str(port))


def test_acknowledged_transitions_survive_sigkill(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_manager(tmp_path, port)
    acked: list[tuple[str, str, object]] = []
    lock = threading.Lock()
    enough = threading.Event()

    def ack(op: str, key: str, result: object) -> None:
        with lock:
            acked.append((op, key, result))
            if len(acked) >= 300:
                enough.set()

    def producer(worker: int) -> None:
        with ManagerClient(url, timeout=5) as client:
            for i in range(10_000):
                g = f"w{worker}-{i}"
                try:
                    version = client.admission()
                    newest = max(version)
                    if version[newest] == 0:
                        continue
                    client.reserve(g, newest)
                    ack("reserve", g, newest)
                    client.occupy(g)
                    ack("occupy", g, None)
                except ServiceError:
                    continue  # refused (e.g. raced for the last slot): nothing was applied
                except httpx.TransportError:
                    return

    def trainer() -> None:
        with ManagerClient(url, timeout=5) as client:
            for _ in range(100_000):
                try:
                    batch = client.consume()
                    ack("consume", str(batch["version"]), batch["group_ids"])
                except ServiceError:
                    continue
                except httpx.TransportError:
                    return

    threads = [threading.Thread(target=producer, args=(w,)) for w in range(4)] + [threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    assert enough.wait(60), "the stream never got going"
    os.kill(proc.pid, signal.SIGKILL)  # requests are in flight right now
    proc.wait()
    for t in threads:
        t.join(30)

    proc = start_manager(tmp_path, port)
    try:
        with ManagerClient(url) as client:
            state = client.buffers()
            t = state["train_version"]
            consumed_versions = {int(k): v for op, k, v in acked if op == "consume"}
            assert consumed_versions and max(consumed_versions) < t
            # no half-applied consume: every consumed buffer holds exactly B groups, all consumed
            for version in range(t):
                batch = client.http.get(f"/v1/buffers/{version}").json()
                assert batch["state"] == "consumed" and len(batch["entries"]) == BATCH
            for version, groups in consumed_versions.items():
                stored = {e["group_id"] for e in client.http.get(f"/v1/buffers/{version}").json()["entries"]}
                assert stored == set(groups)
            for op, g, v_traj in acked:
                if op == "consume":
                    continue
                record = client.http.get(f"/v1/reservations/{g}").json()
                assert record["status"] in ("reserved", "occupied", "consumed"), (op, g, record)
                if op == "occupy":
                    assert record["status"] in ("occupied", "consumed")
            # the reloaded state is consistent and live: the buffers respect the windows, and work goes on
            for b in state["buffers"]:
                assert len(b["entries"]) <= b["capacity"]
                for e in b["entries"]:
                    assert e["v_traj"] <= b["version"] <= e["v_traj"] + ETA
            newest = max(client.admission())
            client.reserve("after-restart", newest)
    finally:
        proc.terminate()
        proc.wait(10)
