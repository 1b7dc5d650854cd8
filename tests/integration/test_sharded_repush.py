"""A sharded trainer's ranks see every version through to visible across parameter-server
crashes: a version the PS lost before persisting it is pushed again by every rank before the next
one, a push cut short by a restart is sent again by every rank, and no torn version is ever
visible. Real PS processes (SIGKILLed), rank 0's trainer role and the other ranks' background
pushers, each with its own ParamsClient."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from support import free_port

from staleflow.servers.trainer import StepLog, TrainerLoop
from staleflow.training.base import BackgroundSharePushes, ShardedWeights
from staleflow.training.simulated import SimulatedBackend
from staleflow.transports.base import ChecksumMismatch, FormatError
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.rest import ServiceError

pytestmark = pytest.mark.timeout(180)

CHUNK = 64 << 10
RANKS = 3
WAIT_S = 0.5  # each bounded wait for the other ranks' parts: short, so a rank looks at the PS again soon
POLL_S = 0.1


def full_state(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {
        "embed.weight": rng.standard_normal((301, 64)).astype(np.float32),  # rows do not split evenly
        "layers.0.norm": rng.standard_normal(2).astype(np.float16),  # fewer rows than ranks
        "layers.0.proj": rng.integers(0, 2**31, (40, 33), dtype=np.int64),
    }


def share_of(state: dict[str, np.ndarray], rank: int) -> ShardedWeights:
    """What an FSDP rank holds: its dim-0 rows of every tensor, placed by offset in the full tensor."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}
    share = ShardedWeights(rank, RANKS, {name: (names[a.dtype], a.shape) for name, a in state.items()})
    for name, array in state.items():
        rows = -(-array.shape[0] // RANKS)
        local = array[rank * rows:(rank + 1) * rows]
        if local.size:
            share.pieces.append(ShardPiece(name, rank * rows * (array.nbytes // array.shape[0]), np.ascontiguousarray(local)))
    return share


class ParamsProcess:
    """A parameter server in a process of its own on a fixed port and state directory, so that
    it can be SIGKILLed and started again where the ranks expect it."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, persist: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "staleflow.cli", "serve", "params", "--state-dir", str(self.state_dir),
             "--port", str(self.port), "--keep", "3", "--chunk-mb", str(CHUNK / (1 << 20)), "--no-fsync",
             "--persist" if persist else "--no-persist"],
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # the socket listens before this line; requests queue until served
            if "listening on" in line:
                break
        else:
            raise AssertionError(f"parameter server exited early with {self.proc.wait()}")
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # a clean stop removes its shared-memory slots
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[ParamsProcess]:
    server = ParamsProcess(tmp_path / "params")
    try:
        yield server
    finally:
        server.stop()


class TornVersionWatch:
    """An instance that pulls the newest version over and over, through crashes and restarts, and
    checks every pulled version against the bytes the ranks pushed for it."""

    def __init__(self, url: str):
        self.url = url
        self.seen: set[int] = set()
        self.mismatches: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> TornVersionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        with ParamsClient(self.url, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    lease = client.open_pull("latest", "shm")
                    try:
                        pulled = dict(client.receive(lease))  # every chunk verified against its checksum
                    finally:
                        client.close_pull(lease)
                except ChecksumMismatch:
                    self.mismatches.append(-1)
                except (ServiceError, httpx.HTTPError, OSError, FormatError):
                    pass  # nothing visible yet, or the PS went down mid-pull
                else:
                    version = lease.manifest.version
                    self.seen.add(version)
                    expected = full_state(version)
                    if set(pulled) != set(expected) or any(pulled[n].tobytes() != a.tobytes() for n, a in expected.items()):
                        self.mismatches.append(version)
                self._stop.wait(0.02)  # poll pacing


class Ranks:
    """Rank 0: the trainer role's push (``TrainerLoop._push``, which returns once the version is
    visible); ranks 1..: the background pushers FSDP's other ranks use, each submitted from a
    thread of its own as a follower's main thread does."""

    def __init__(self, url: str, tmp_path: Path):
        self.client = ParamsClient(url, timeout=60)
        backend = SimulatedBackend(0.0, 0.0, 1, 1.0, threading.Event())
        self.loop = TrainerLoop(backend, steps=10, eta=1, urls={"params": url}, step_log=StepLog(tmp_path / "steps"),
                                stop=threading.Event())
        self.loop.params = self.client
        self.followers = [BackgroundSharePushes(url, rank, wait_s=WAIT_S, poll_s=POLL_S) for rank in range(1, RANKS)]

    def follow(self, version: int, ranks: list[int] | None = None) -> list[threading.Thread]:
        """Ranks ``ranks`` (default: all followers) snapshot and submit ``version``; returns their threads."""
        threads = []
        for rank in ranks or list(range(1, RANKS)):
            share = share_of(full_state(version), rank)
            thread = threading.Thread(target=self.followers[rank - 1].submit, args=(version, share))
            thread.start()
            threads.append(thread)
        return threads

    def lead(self, version: int) -> None:
        self.loop._push(version, share_of(full_state(version), 0))

    def close(self) -> None:
        for follower in self.followers:
            follower.close()
        self.client.close()


def assert_visible_with_the_right_bytes(url: str, versions: list[int]) -> None:
    with ParamsClient(url) as client:
        assert [v["version"] for v in client.versions()["versions"]] == versions
        for version in versions:
            for transport in ("shm", "http"):
                pulled = client.pull(version, transport)
                assert {n: a.tobytes() for n, a in pulled.items()} == {n: a.tobytes() for n, a in full_state(version).items()}


def test_every_rank_pushes_again_a_version_the_ps_lost_then_the_next(ps: ParamsProcess, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="staleflow.training.base")
    ps.start(persist=False)  # a PS that never persists: a visible version lives in its memory only
    ranks = Ranks(ps.url, tmp_path)
    try:
        with TornVersionWatch(ps.url) as watch:
            followers = ranks.follow(1)
            ranks.lead(1)
            for thread in followers:
                thread.join()
            state = ranks.client.versions()
            assert [(v["version"], v["persisted"]) for v in state["versions"]] == [(1, False)]

            ps.kill()
            ps.start(persist=False)
            with pytest.raises(ServiceError):
                ranks.client.latest()  # version 1 died with the PS

            followers = ranks.follow(2)
            ranks.lead(2)  # rank 0 finds version 1 lost and pushes its share again before version 2
            for thread in followers:
                thread.join()
            for follower in ranks.followers:
                follower.wait()
                assert follower.kept_version == 2  # the older share went when version 2 was visible
            assert ranks.loop._share_pusher is not None and ranks.loop._share_pusher.kept[0] == 2
        assert_visible_with_the_right_bytes(ps.url, [1, 2])
        assert watch.mismatches == [] and watch.seen <= {1, 2}
        repushed = [r.getMessage() for r in caplog.records if "lost version 1" in r.getMessage()]
        assert any("rank 0 pushes its share of it again before version 2" in m for m in repushed), repushed
    finally:
        ranks.close()


@pytest.mark.parametrize("persisted", [False, True], ids=["previous-lost", "previous-persisted"])
def test_a_restart_with_parts_pending_makes_every_rank_send_its_part_again(ps: ParamsProcess, tmp_path: Path,
                                                                          persisted: bool) -> None:
    """Ranks 0 and 1 have handed in their parts of version 2 when the PS dies; rank 2 comes after
    the restart. Every rank joins the new PS's push again. When version 1 was lost too (never
    persisted), rank 2 finds it lost and pushes it again, and ranks 0 and 1, which cannot tell
    whether version 2 became visible unseen, join that push; version 1 becomes visible first."""
    ps.start(persist=persisted)
    ranks = Ranks(ps.url, tmp_path)
    try:
        with TornVersionWatch(ps.url) as watch:
            followers = ranks.follow(1)
            ranks.lead(1)
            for thread in followers:
                thread.join()
            if persisted:
                assert ranks.client.wait_persisted(1, 60)
                ranks.loop._release_persisted_share()
                assert ranks.loop._share_pusher is not None and ranks.loop._share_pusher.kept is None

            rank0 = threading.Thread(target=ranks.lead, args=(2,))
            rank0.start()
            rank1 = ranks.follow(2, [1])
            while True:  # poll pacing until the PS has both parts
                pending = [p for p in ranks.client.versions()["pushes"] if p["version"] == 2]
                if pending and set(pending[0]["parts_done"]) == {0, 1}:
                    break
                time.sleep(0.02)
            ps.kill()
            ps.start(persist=persisted)
            if persisted:
                assert [v["version"] for v in ranks.client.versions()["versions"]] == [1]

            rank2 = ranks.follow(2, [2])
            for thread in [rank0, *rank1, *rank2]:
                thread.join()
            for follower in ranks.followers:
                follower.wait()
        assert_visible_with_the_right_bytes(ps.url, [1, 2])
        assert watch.mismatches == []
    finally:
        ranks.close()
