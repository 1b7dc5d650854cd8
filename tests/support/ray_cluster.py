"""Helpers of the Ray launcher's end-to-end tests: a loopback-only network namespace, polling
with a deadline, the processes a local cluster ran, a job started as a user starts it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}
"""Every node of a test cluster: bound to 127.0.0.1, a small object store."""


@contextlib.contextmanager
def loopback_only_network() -> Iterator[None]:
    """Put this thread, and every process and thread it starts from now on, into a new network
    namespace with only the loopback interface up; back to the original one at the end."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    if libc.unshare(CLONE_NEWNET) != 0:
        os.close(original)
        warnings.warn(f"cannot create a network namespace ({os.strerror(ctypes.get_errno())}; needs root or "
                      "CAP_SYS_ADMIN): the Ray tests run in this machine's network, bound to 127.0.0.1", stacklevel=2)
        yield
        return
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        yield
    finally:
        libc.setns(original, CLONE_NEWNET)
        os.close(original)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a live process, None if it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), fields[0])


def descendants(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))):
            parents[int(entry.name)] = st[0]
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += sorted(frontier)
    return found


def still_running(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        if _stat(pid) is not None:
            with contextlib.suppress(OSError):
                alive.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:120]!r}")
    return alive


# ---------------------------------------------------------------------------- the cluster and the job


@dataclass
class ClusterRun:
    """A local Ray cluster a test module started, this process its driver."""

    cluster: Any
    nodes: list[Any]  # the nodes added beside the head, in order
    before: frozenset[int] = frozenset()  # this process's descendants before the cluster (earlier tests' helpers)
    stopped: bool = False

    def stop(self) -> list[int]:
        """Stop the cluster; the processes it ran (this process's descendants just before, less
        those that were there before the cluster started)."""
        import ray

        if self.stopped:
            return []
        self.stopped = True
        ran = [pid for pid in descendants(os.getpid()) if pid not in self.before]
        with contextlib.suppress(Exception):
            ray.shutdown()
        self.cluster.shutdown()
        return ran


@contextlib.contextmanager
def local_ray_cluster(namespace: str, head: dict, nodes: list[dict]) -> Iterator[ClusterRun]:
    """A ``ray.cluster_utils.Cluster`` (``Cluster.add_node`` arguments for the head and each other
    node) in a loopback-only network namespace, this process attached as a driver in
    ``namespace``; stopped at the end."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    before = frozenset(descendants(os.getpid()))  # e.g. multiprocessing's resource tracker from an earlier test
    with loopback_only_network():
        cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
        run = None
        try:
            added = [cluster.add_node(**node) for node in nodes]
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
            run = ClusterRun(cluster, added, before)
            yield run
        finally:
            if run is None:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                cluster.shutdown()
            else:
                run.stop()


def wait_for(condition: Callable[[], Any], timeout: float, what: str, pace: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            value = condition()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(pace)  # polling pace




@dataclass
class RunningJob:
    proc: subprocess.Popen
    state: Path
    config: Path
    events: list[dict] = field(default_factory=list)
    output: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))

    def event(self, kind: str, name: str | None = None) -> dict | None:
        return next((e for e in self.events if e["event"] == kind and (name is None or e.get("name") == name)), None)


def start_up(tmp: Path, config: Path, state: Path) -> RunningJob:
    proc = subprocess.Popen([sys.executable, "-m", "staleflow.cli", "up", "--launcher", "ray", "--config", str(config),
                             "--state-dir", str(state), "--json-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    job = RunningJob(proc, state, config)
    threading.Thread(target=job.read, daemon=True).start()
    return job
