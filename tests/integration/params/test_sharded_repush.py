"""A sharded trainer's ranks see every version through to visible across parameter-server
crashes: a version the PS lost before persisting it is pushed again by every rank before the next
one, a push cut short by a restart is sent again by every rank, and no torn version is ever
visible. Real PS processes (SIGKILLed), rank 0's trainer role and the other ranks' background
pushers, each with its own ParamsClient."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support import ParamsProcess

from staleflow.api.base import ServiceError
from staleflow.training.base import BackgroundSharePushes, ShardedWeights
from staleflow.training.export import LocalShard, ShareStaging
from staleflow.training.role import StepLog, TrainerLoop
from staleflow.training.simulated import SimulatedBackend
from staleflow.transports.client import ParamsClient, ShardPiece
from staleflow.transports.errors import ChecksumMismatch, FormatError

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


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[ParamsProcess]:
    server = ParamsProcess(tmp_path / "params", "--keep", "3", "--chunk-mb", str(CHUNK / (1 << 20)))
    try:
        yield server
    finally:
        server.stop()


class TornVersionWatch:
    """An instance that pulls the newest version over and over, through crashes and restarts, and
    checks every pulled version against the bytes the ranks pushed for it."""

    def __init__(self, url: str, expected: Callable[[int], dict[str, bytes]] | None = None):
        self.url = url
        self.expected = expected or (lambda version: {n: a.tobytes() for n, a in full_state(version).items()})
        self.seen: set[int] = set()
        self.mismatches: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> TornVersionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _watch(self) -> None:
        try:
            self._pull_over_and_over()
        except BaseException as exc:  # surfaced in the test's thread
            self.error = exc

    def _pull_over_and_over(self) -> None:
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
                    expected = self.expected(version)
                    if {n: a.tobytes() for n, a in pulled.items()} != expected:
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
            thread = threading.Thread(target=self._follow, args=(self.followers[rank - 1], version, rank))
            thread.start()
            threads.append(thread)
        return threads

    @staticmethod
    def _follow(pushes: BackgroundSharePushes, version: int, rank: int) -> None:
        pushes.wait()  # FSDP's push_shards: the previous version is visible, then the snapshot
        pushes.submit(version, share_of(full_state(version), rank))

    def lead(self, version: int) -> None:
        self.loop._push(version, share_of(full_state(version), 0))

    def push(self, version: int) -> None:
        """Every rank pushes ``version`` at once; returns when rank 0 saw it visible and every follower submitted."""
        followers = self.follow(version)
        self.lead(version)
        for thread in followers:
            thread.join()

    def close(self) -> None:
        for follower in self.followers:
            follower.close()
        self.client.close()


def assert_visible_with_the_right_bytes(url: str, versions: list[int]) -> None:
    with ParamsClient(url) as client:
        assert [v.version for v in client.versions().versions] == versions
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
            ranks.push(1)
            state = ranks.client.versions()
            assert [(v.version, v.persisted) for v in state.versions] == [(1, False)]

            ps.kill()
            ps.start(persist=False)
            with pytest.raises(ServiceError):
                ranks.client.latest()  # version 1 died with the PS

            ranks.push(2)  # rank 0 finds version 1 lost and pushes its share again before version 2
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
            ranks.push(1)
            if persisted:
                assert ranks.client.wait_persisted(1, 60)
                ranks.loop._release_persisted_share()
                assert ranks.loop._share_pusher is not None and ranks.loop._share_pusher.kept is None
                for follower in ranks.followers:
                    follower.wait()  # as before the next snapshot
                    assert follower.kept_version is None  # persisted: no rank holds a share of it any more

            rank0 = threading.Thread(target=ranks.lead, args=(2,))
            rank0.start()
            rank1 = ranks.follow(2, [1])
            while True:  # poll pacing until the PS has both parts
                pending = [p for p in ranks.client.versions().pushes if p.version == 2]
                if pending and set(pending[0].parts_done) == {0, 1}:
                    break
                time.sleep(0.02)
            ps.kill()
            ps.start(persist=persisted)
            if persisted:
                assert [v.version for v in ranks.client.versions().versions] == [1]

            rank2 = ranks.follow(2, [2])
            for thread in [rank0, *rank1, *rank2]:
                thread.join()
            for follower in ranks.followers:
                follower.wait()
        assert_visible_with_the_right_bytes(ps.url, [1, 2])
        assert watch.mismatches == []
    finally:
        ranks.close()


class Partition:
    """A TCP relay between one rank and the PS that can drop the PS's answers (a network
    partition), so that the rank misses its version becoming visible."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()  # the PS is down: so is the relay
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if not (answers and self.cut.is_set()):
                    target.sendall(data)
        except OSError:
            pass
        for s in (source, target):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def heal(self) -> None:
        """Answers flow again; connections of the cut ended."""
        self.cut.clear()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._sockets.clear()

    def close(self) -> None:
        self.listener.close()
        self.heal()


def test_a_rank_that_missed_its_version_becoming_visible_pushes_it_again_not_the_older_one(
        ps: ParamsProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 hands in its part of version 2 and misses the answer that version 2 is visible; the
    PS dies before persisting it (and version 1). Ranks 1 and 2 saw version 2 visible and let
    their shares of version 1 go, so rank 0 must not wait for version 1: every rank pushes version
    2 again (ranks 1 and 2 between pushes, as they hold it until it is persisted)."""
    caplog.set_level(logging.WARNING, logger="staleflow.training.base")
    ps.start(persist=False)
    partition = Partition(ps.port)
    ranks = Ranks(partition.url, tmp_path)
    ranks.followers = [BackgroundSharePushes(ps.url, rank, wait_s=WAIT_S, poll_s=POLL_S) for rank in range(1, RANKS)]
    try:
        with TornVersionWatch(ps.url) as watch, ParamsClient(ps.url) as observer:
            ranks.push(1)

            rank0 = threading.Thread(target=ranks.lead, args=(2,))
            rank0.start()
            while not any(p.version == 2 and 0 in p.parts_done for p in observer.versions().pushes):
                time.sleep(0.02)  # poll pacing until rank 0's part is in
            partition.cut.set()
            for thread in ranks.follow(2):
                thread.join()
            while any(f.kept_version != 2 for f in ranks.followers):
                time.sleep(0.02)  # poll pacing until ranks 1 and 2 saw version 2 visible
            assert [v.version for v in observer.versions().versions] == [1, 2]
            ps.kill()
            partition.heal()
            ps.start(persist=False)

            rank0.join()
            for follower in ranks.followers:
                follower.wait()
        assert_visible_with_the_right_bytes(ps.url, [2])
        assert watch.mismatches == []
        assert not [r.getMessage() for r in caplog.records if "lost version 1" in r.getMessage()]
        assert any("lost version 2" in r.getMessage() for r in caplog.records)
    finally:
        ranks.close()
        partition.close()


# ------------------------------------------- exports overlapped with the next step

def trained_state(version: int) -> dict[str, torch.Tensor]:
    """What a trainer holds after ``version`` steps: fp32 master weights and an integer buffer."""
    generator = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn((301, 64), generator=generator),
        "layers.0.norm": torch.randn(2, generator=generator),
        "layers.0.proj": torch.randint(0, 2**31, (40, 33), generator=generator, dtype=torch.int64),
    }


def exported_bytes(version: int) -> dict[str, bytes]:
    """What the engine must see of ``version``: floating tensors as bf16, the rest as they are."""
    return {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous().view(torch.uint8).numpy().tobytes()
            for name, t in trained_state(version).items()}


class OverlappedRanks(Ranks):
    """Every rank exports its rows of the parameters into its reusable staging buffers (bf16),
    hands the share to its pusher and goes on with the next step at once: the step writes the
    parameters in place while the pushes (and any push again of the kept share) are in flight."""

    def __init__(self, url: str, tmp_path: Path):
        super().__init__(url, tmp_path)
        self.parameters = trained_state(0)
        self.staging = [ShareStaging(rank, RANKS, torch.bfloat16) for rank in range(RANKS)]
        self.pushing = ThreadPoolExecutor(1, thread_name_prefix="rank-0-push")  # the trainer role's push thread
        self.lead_push: Future | None = None

    def export(self, rank: int) -> ShardedWeights:
        shards = []
        for name, tensor in self.parameters.items():
            rows = -(-tensor.shape[0] // RANKS)
            shards.append(LocalShard(name, tuple(tensor.shape), rank * rows, tensor[rank * rows:(rank + 1) * rows]))
        return self.staging[rank].export(shards)

    def publish_then_step(self, version: int, during_step: Callable[[], None] = lambda: None,
                          late: tuple[int, ...] = ()) -> None:
        """As the trainer does: rank 0 waits for its previous push, every rank exports ``version``
        and pushes it, and the next step (``version + 1``) overwrites the parameters meanwhile.
        The ranks in ``late`` hand their exported shares to their pushers only once ``during_step``
        returned: until then the push cannot complete."""
        if self.lead_push is not None:
            self.lead_push.result()
        self.lead_push = self.pushing.submit(self.loop._push, version, self.export(0))
        held = []
        for rank, pushes in enumerate(self.followers, start=1):
            pushes.wait()
            share = self.export(rank)
            if rank in late:
                held.append((pushes, share))
            else:
                pushes.submit(version, share)
        during_step()
        for pushes, share in held:
            pushes.submit(version, share)
        for name, tensor in trained_state(version + 1).items():
            self.parameters[name].copy_(tensor)  # the optimizer step writes the parameters in place

    def settle(self) -> None:
        if self.lead_push is not None:
            self.lead_push.result()
        for pushes in self.followers:
            pushes.wait()

    def close(self) -> None:
        self.pushing.shutdown()
        super().close()


def assert_exported(url: str, versions: list[int]) -> None:
    with ParamsClient(url) as client:
        assert [v.version for v in client.versions().versions] == versions
        for version in versions:
            assert {n: a.tobytes() for n, a in client.pull(version, "shm").items()} == exported_bytes(version)
        assert {t.name: t.dtype for t in client.manifest(versions[-1]).tensors} == \
            {"embed.weight": "BF16", "layers.0.norm": "BF16", "layers.0.proj": "I64"}


def test_no_torn_version_while_the_next_step_overwrites_what_was_exported(ps: ParamsProcess, tmp_path: Path) -> None:
    """The PS dies with a visible, unpersisted version while the next step runs, and then drops
    a push in flight: the ranks push their kept shares again from the staging buffers while new
    versions are exported into them, and every version any instance sees is exactly the bf16 of
    the parameters it was exported from."""
    ps.start(persist=False)
    ranks = OverlappedRanks(ps.url, tmp_path)
    with ParamsClient(ps.url) as observer:
        def kill_and_restart() -> None:
            ranks.lead_push.result()  # version 1 visible (in the PS's memory only) ...
            ps.kill()  # ... and lost with it while the next step runs
            ps.start(persist=False)

        def drop_the_push() -> None:
            deadline = time.monotonic() + 60
            while not (pending := [p for p in observer.versions().pushes if p.version == 3]):
                assert time.monotonic() < deadline, f"no push of version 3 on the PS: {observer.versions()}"
                time.sleep(0.01)  # poll pacing until the push of version 3 is on the PS
            dropped = observer.http.delete("/v1/params/3/push", params={"push_id": pending[0].push_id})
            assert dropped.status_code == 200, dropped.text

        try:
            with TornVersionWatch(ps.url, exported_bytes) as watch:
                for name, tensor in trained_state(1).items():
                    ranks.parameters[name].copy_(tensor)
                ranks.publish_then_step(1, kill_and_restart)
                ranks.publish_then_step(2)  # version 1 was lost: every rank pushes its kept share of it again first
                ranks.settle()
                assert_exported(ps.url, [1, 2])  # pushed again from its own buffer, not the one version 2 went into
                ranks.publish_then_step(3, drop_the_push, late=(RANKS - 1,))  # pending until it is dropped
                ranks.publish_then_step(4)
                ranks.settle()
            assert_exported(ps.url, [2, 3, 4])
            assert watch.mismatches == [] and watch.seen
        finally:
            ranks.close()
