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

from staleflow.api.base import ServiceError
from staleflow.api.manager import ManagerClient

ETA, BATCH = 2, 8


def start_manager(state_dir: Path, port: int, db_url: str | None) -> subprocess.Popen:
    return start_cli("serve", "manager", "--eta", str(ETA), "--batch-size", str(BATCH), "--group-size", "1",
                     "--state-dir", str(state_dir), "--port", str(port), *(["--db", db_url] if db_url else []))


def test_acknowledged_transitions_survive_sigkill(tmp_path: Path, db_url: str | None) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_manager(tmp_path, port, db_url)
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
                    version = client.admission().by_version()
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
                    ack("consume", str(batch.version), batch.group_ids)
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

    proc = start_manager(tmp_path, port, db_url)  # on PostgreSQL: once the server dropped the dead one's session
    try:
        with ManagerClient(url) as client:
            state = client.buffers()
            t = state.train_version
            consumed_versions = {int(k): v for op, k, v in acked if op == "consume"}
            assert consumed_versions and max(consumed_versions) < t
            # no half-applied consume: every consumed buffer holds exactly B groups, all consumed
            for version in range(t):
                buffer = client.buffer(version)
                assert buffer.state == "consumed" and len(buffer.entries) == BATCH
            for version, groups in consumed_versions.items():
                stored = {e.group_id for e in client.buffer(version).entries}
                assert stored == set(groups)
            for op, g, _v_traj in acked:
                if op == "consume":
                    continue
                record = client.reservation(g)
                assert record.status in ("reserved", "occupied", "consumed"), (op, g, record)
                if op == "occupy":
                    assert record.status in ("occupied", "consumed")
            # the reloaded state is consistent and live: the buffers respect the windows, and work goes on
            for b in state.buffers:
                assert len(b.entries) <= b.capacity
                for e in b.entries:
                    assert e.v_traj is not None and e.v_traj <= b.version <= e.v_traj + ETA
            newest = max(client.admission().by_version())
            client.reserve("after-restart", newest)
    finally:
        proc.terminate()
        proc.wait(10)
