"""What the trainer role needs from a trainer backend, and how a sharded trainer's ranks push.

The role (``staleflow.training.role``) does the I/O: it consumes a Ready buffer, fetches its batch,
hands it to the backend, pushes the weights the backend returns and frees batches once a checkpoint
covers them. A backend only trains, so the same role drives the simulated trainer and the FSDP one.

A sharded backend's ranks each push their own share of a version (``ShardedWeights``) with a
``SharePusher``: rank 0 from the role, the other ranks in the background (``BackgroundSharePushes``).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from staleflow.api.base import ServiceError
from staleflow.api.params import PushProgress, StoreDescription
from staleflow.errors import ErrorCode
from staleflow.transports.client import ParamsClient, ShardPiece

log = logging.getLogger(__name__)


@dataclass
class ShardedWeights:
    """One pusher's share of a version that several push at once (a sharded trainer's ranks):
    the whole tensor table and the pieces this one holds, snapshotted so training can go on.
    ``ready``, when set, returns once the pieces' bytes have landed (a copy still in flight)."""

    part: int
    parts: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, full shape)
    pieces: list[ShardPiece] = field(default_factory=list)
    ready: Callable[[], Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def push(self, client: ParamsClient, version: int, wait_s: float = 600.0) -> dict:
        """Push this share; returns when the version is visible (every part in) or ``wait_s`` ran out."""
        if self.ready is not None:
            self.ready()
        return client.push_part(version, self.part, self.parts, self.tensors, self.pieces, wait_s=wait_s)


class TrainerBackend(abc.ABC):
    label: str = "trainer"

    def resume_version(self) -> int | None:
        """Buffers this backend has already trained, per its newest checkpoint; ``None`` when the
        backend keeps no state of its own (the role then trusts the parameter server's latest)."""
        return None

    @abc.abstractmethod
    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        """Train on buffer ``version``'s batch (the trajectory server's ``/v1/batches/{version}``
        document); returns the step's metrics, at least ``train_seconds``."""

    @abc.abstractmethod
    def weights(self, version: int) -> Mapping[str, Any] | ShardedWeights:
        """The state to push as ``version``, as tensors that the next ``train`` does not modify:
        the whole state dict, or this process's share of it when every shard holder pushes its own."""

    def checkpoint(self, version: int) -> bool:
        """Called after each step with the number of buffers trained so far. Returns True when a
        durable checkpoint now covers them (their batches are then no longer needed)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


# ---------------------------------------------------------------- sharded pushes

VISIBLE_WAIT_S = 5.0
"""One bounded wait of a pushing rank for the other ranks' parts; it asks the PS again after each."""
KEPT_POLL_S = 1.0
"""Between pushes, how often a rank asks the PS whether its last version is persisted (or lost)."""
RETRIED_CODES = (
    ErrorCode.UNKNOWN_PUSH,  # the PS restarted or dropped the push: join it again
    ErrorCode.PUSH_ID_MISMATCH,  # ... and another rank started a new one
    ErrorCode.UNKNOWN_PART,
    ErrorCode.VERSION_INCOMPLETE,
    ErrorCode.BUSY,
    ErrorCode.VERSION_EXISTS,  # visible meanwhile: the next look at the PS says so
    ErrorCode.VERSION_TOO_OLD,  # superseded meanwhile: likewise
)


class PushStopped(Exception):
    """The pushing rank was told to stop before its version was visible."""


def is_visible(state: StoreDescription, version: int) -> bool:
    """``version`` is visible on the PS (``GET /v1/params``; its holders serving it where the PS
    dropped its copy), or superseded by a newer visible one."""
    return (any(v.version == version for v in state.versions) or version in state.referenced
            or newer_visible(state, version))


def newer_visible(state: StoreDescription, version: int) -> bool:
    """A version newer than ``version`` is visible on the PS."""
    return state.latest is not None and state.latest > version


def is_persisted(state: StoreDescription, version: int) -> bool:
    return any(v.version == version and v.persisted for v in state.versions)


def pending_push(state: StoreDescription, version: int) -> PushProgress | None:
    return next((p for p in state.pushes if p.version == version), None)


class SharePusher:
    """One rank's pushes of its share of each version, each seen through to visible across
    parameter-server restarts and dropped pushes (bounded waits in a retry loop). Not
    thread-safe: one per pushing thread, and one ``ParamsClient`` per thread.

    The PS makes a version visible from memory and persists it later, so a restart can lose a
    visible version. The rank keeps its last pushed share (``kept``) until the PS reports that
    version persisted or a newer version of its own is visible. Whenever it looks at the PS
    while pushing the next version and finds the kept one lost (not visible, the PS's latest is
    older), it pushes the kept share again and waits for it to be visible first: the PS refuses
    a version older than its newest visible one. Every rank decides from the PS's state alone,
    so all of them push the same version again, whether they looked before or after the restart.

    One rank cannot decide alone: one that handed in its part of the version it is pushing may
    have missed that version becoming visible just before the PS died, and then the other ranks
    have let their older shares go. Such a rank pushes its kept share again only once another
    rank has started that push on the PS; otherwise it pushes its part of the newer version."""

    def __init__(self, part: int, *, stop: threading.Event | None = None, wait_s: float = VISIBLE_WAIT_S,
                 outage_s: float | None = None):
        self.part = part
        self.stop = stop or threading.Event()
        self.wait_s = wait_s
        self.outage_s = outage_s
        self.kept: tuple[int, ShardedWeights] | None = None

    def push(self, client: ParamsClient, version: int, share: ShardedWeights) -> None:
        """Push ``share`` as this rank's part of ``version`` and return once it is visible (after
        pushing the kept version again if the PS lost it); raises ``PushStopped`` on ``stop``."""
        self._see_through(client, version, share, self.kept if self.kept and self.kept[0] < version else None)
        self.kept = (version, share)  # the older share goes: a newer version of this rank's is visible

    def keep_until_persisted(self, client: ParamsClient, superseded: threading.Event, poll_s: float = KEPT_POLL_S) -> None:
        """Between pushes: hold the kept share until the PS reports it persisted (then release it)
        or ``superseded`` is set (the next push takes over), pushing it again if the PS loses it
        meanwhile, so that a rank waiting for the other ranks' parts of it is not left waiting."""
        backoff = poll_s
        while self.kept is not None and not superseded.is_set() and not self.stop.is_set():
            version, share = self.kept
            try:
                state = client.versions()
            except (httpx.TransportError, OSError, ServiceError) as exc:
                if isinstance(exc, ServiceError) and not exc.transient:
                    raise
                log.info("rank %d: the parameter server does not answer (%s); asking again", self.part, exc)
            else:
                if is_persisted(state, version) or newer_visible(state, version):
                    self.kept = None
                    return
                if not is_visible(state, version):
                    self._warn_lost(version, None)
                    self._see_through(client, version, share, None)
                    continue
            superseded.wait(backoff)  # poll pacing; the next push sets it
            backoff = min(backoff * 2, 8 * poll_s)

    def release_if_persisted(self, client: ParamsClient, timeout_s: float = 10.0) -> None:
        """Let the kept share go if the PS reports it persisted (one look; an unanswered one keeps it)."""
        if self.kept is None:
            return
        try:
            state = client.versions(timeout=timeout_s)
        except (httpx.TransportError, OSError, ServiceError):
            return
        if is_persisted(state, self.kept[0]):
            self.kept = None

    # -- internals

    def _see_through(self, client: ParamsClient, version: int, share: ShardedWeights,
                     kept: tuple[int, ShardedWeights] | None) -> None:
        push_id: str | None = None
        handed_in = False  # once this part may have been handed in, the version may become visible unseen
        failing_since: float | None = None
        warned = time.monotonic()
        backoff = 0.05
        while True:
            if self.stop.is_set():
                raise PushStopped(f"rank {self.part}: push of version {version}")
            try:
                state = client.versions()
                if is_visible(state, version):
                    return
                if kept is not None and not is_visible(state, kept[0]) and \
                        (not handed_in or pending_push(state, kept[0]) is not None):
                    self._warn_lost(kept[0], version)
                    self._see_through(client, kept[0], kept[1], None)
                    continue
                pending = pending_push(state, version)
                if pending is not None and pending.parts != share.parts:
                    # left by a killed trainer of another shape: it can never complete
                    client.abort_push(version, pending.push_id)
                    pending = None
                if pending is not None and push_id is not None and pending.push_id == push_id \
                        and self.part in pending.parts_done:
                    reply = client.finish_part(version, self.part, push_id, wait_s=self.wait_s)
                else:
                    handed_in = True
                    reply = share.push(client, version, wait_s=self.wait_s)
                if reply.get("visible"):
                    return
                push_id = reply.get("push_id")
                failing_since = None
                backoff = 0.05
                continue
            except ServiceError as exc:
                if not exc.transient and exc.code not in RETRIED_CODES:
                    raise
                problem: Exception = exc
            except (httpx.TransportError, OSError) as exc:  # OSError: the PS's raw push socket or its memory slot
                problem = exc
            push_id = None
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if self.outage_s is not None and now - failing_since > self.outage_s:
                raise RuntimeError(f"rank {self.part}: push of version {version} still failing after "
                                   f"{self.outage_s:.0f} s: {problem}") from problem
            if now - warned > 30:
                warned = now
                log.warning("rank %d: push of version %d still failing after %.0f s (%s); retrying", self.part, version,
                            now - failing_since, problem)
            else:
                log.info("rank %d: push of version %d: %s; retrying", self.part, version, problem)
            self.stop.wait(backoff)  # retry pacing while the parameter server restarts
            backoff = min(backoff * 2, 1.0)

    def _warn_lost(self, lost: int, before: int | None) -> None:
        then = f" before version {before}" if before is not None else ""
        log.warning("the parameter server lost version %d (visible, not yet persisted): rank %d pushes its share "
                    "of it again%s", lost, self.part, then)


class BackgroundSharePushes:
    """A rank's pushes on a thread of their own, one at a time, so training goes on meanwhile:
    ``wait`` for the previous version to be visible, then ``submit`` the next. Between pushes the
    thread keeps the last share until the PS persisted it, pushing it again if the PS loses it
    (see ``SharePusher``), so that the other ranks are never left waiting for its part."""

    def __init__(self, url: str, part: int, *, wait_s: float = VISIBLE_WAIT_S, poll_s: float = KEPT_POLL_S,
                 remote_push: str = "http"):
        self.url = url
        self.remote_push = remote_push
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._pusher = SharePusher(part, stop=self._stop, wait_s=wait_s)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"push-part-{part}")
        self._client: ParamsClient | None = None  # that thread's; kept: its shared-memory mappings stay warm
        self._pushing: Future | None = None
        self._superseded = threading.Event()

    @property
    def kept_version(self) -> int | None:
        kept = self._pusher.kept
        return None if kept is None else kept[0]

    def submit(self, version: int, share: ShardedWeights) -> None:
        """Push ``share`` as this rank's part of ``version`` in the background; the previous push
        must be over (``wait``)."""
        if self._pushing is not None:
            raise RuntimeError("one push at a time: wait() for the previous version before submitting the next")
        self._superseded = threading.Event()
        self._pushing = self._executor.submit(self._push, version, share, self._superseded)

    def wait(self) -> None:
        """Until the last submitted version is visible (or its push failed or was stopped); then
        its share is let go if the PS persisted it, before the caller snapshots the next one."""
        self._superseded.set()
        if self._pushing is not None:
            self._pushing.result()
            self._pushing = None
            if not self._stop.is_set():
                self._executor.submit(self._release_if_persisted).result()

    def close(self) -> None:
        """Stop: a push in flight is abandoned (the trainer is stopping)."""
        self._stop.set()
        self.wait()
        self._executor.submit(self._close_client).result()
        self._executor.shutdown()

    def _push(self, version: int, share: ShardedWeights, superseded: threading.Event) -> None:
        if self._client is None:
            self._client = ParamsClient(self.url, timeout=300, remote_push=self.remote_push)
        try:
            self._pusher.push(self._client, version, share)
            self._pusher.keep_until_persisted(self._client, superseded, self.poll_s)
        except PushStopped:
            log.info("rank %d: push of version %d stopped", self._pusher.part, version)
        except Exception:  # a refusal that retrying cannot fix: logged, and the rank goes on training
            log.exception("rank %d: push of version %d failed", self._pusher.part, version)

    def _release_if_persisted(self) -> None:
        if self._client is not None:
            self._pusher.release_if_persisted(self._client)

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
