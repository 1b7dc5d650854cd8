"""The ``nixl`` transport: versions move between the PS's memory and its clients with NIXL (UCX
backend), the library the paper's PS uses (Appendix A). Optional: ``pip install
staleflow[nixl]``; NIXL's Python API imports torch, so install ``torch==2.13.0`` first.

Server side, :class:`NixlExporter` owns the PS's NIXL agent. For pulls it maps each stored
version file and registers the mapping; a pull lease carries the agent's metadata (with the
memory keys) and the base address. For pushes it registers the data section of the memory slot
a pending push is assembled in; the join answer carries the same metadata, the slot's address
and the data offset.

Client side, :class:`NixlTransport` registers its own buffers and is the initiator both ways:
a pull READs each chunk out of the PS's memory, a push WRITEs each chunk into the slot. Pushes
are WRITEs by the pusher rather than READs by the PS because then the PS's agent stays passive
(it never needs the pushers' metadata or addresses, nor spends a request thread driving
transfers), a pusher's failure stays in the pusher, and the push has the shape of the ``shm``
push: bytes land in the slot, then the pusher's ``done`` hands in its chunks' checksums. Those
are computed over the pusher's *source* bytes, and the PS hashes the bytes that landed in the
slot before the part counts as done, so a torn or changed write is refused, never made visible.

Between processes on one host UCX picks its ``cma`` zero-copy path; across hosts, RDMA or TCP.
On this project's 2-core CPU machines NIXL measured 3-7 GB/s (dependencies-measured.md §2.3),
below ``shm``; its point is the same API on GPU/RDMA deployments.
"""

from __future__ import annotations

import base64
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from staleflow.transports.base import PullLease, PushSession, Transport
from staleflow.transports.checksums import chunk_checksums
from staleflow.transports.errors import TransportUnavailable
from staleflow.transports.layout import ChunkSpec
from staleflow.transports.regions import ByteRegions

INSTALL_HINT = "install the optional extra: pip install torch==2.13.0 'staleflow[nixl]'"

# How often the PS's passive agent is progressed (see NixlExporter): often while a push over NIXL
# is open or a pull lease was handed out lately (a UCX TCP lane needs the target to take the
# bytes), rarely otherwise (connection requests from new clients only).
BUSY_PROGRESS_S = 0.001
IDLE_PROGRESS_S = 0.05
BUSY_AFTER_LEASE_S = 30.0


def load_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config), or TransportUnavailable saying how to get them."""
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError as exc:  # also raised by a broken native library
            errors.append(f"{module}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # it logs each agent's creation at INFO on stdout, where --json output goes
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api.nixl_agent, api.nixl_agent_config
    raise TransportUnavailable(f"NIXL is not importable here ({'; '.join(errors)}); {INSTALL_HINT}")


def nixl_available() -> tuple[bool, str]:
    try:
        load_nixl()
    except TransportUnavailable as exc:
        return False, str(exc)
    return True, ""


def _new_agent(prefix: str) -> Any:
    # NIXL's own progress thread spins: one core per agent even when idle (measured here). An
    # initiator progresses its agent by polling its transfers; the PS pumps its passive one.
    agent_cls, config_cls = load_nixl()
    return agent_cls(f"{prefix}-{uuid.uuid4().hex[:8]}", config_cls(enable_prog_thread=False, backends=["UCX"]))


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


def _merged_regions(views: Iterable[memoryview]) -> list[tuple[int, int, int, str]]:
    """Registration descriptors covering ``views``, adjacent and overlapping ones merged."""
    spans = sorted((_address(v), len(v)) for v in views if len(v))
    merged: list[list[int]] = []
    for start, length in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length])
    return [(start, length, 0, "") for start, length in merged]


class _Export:
    """One stored version mapped into the PS and registered with its agent."""

    def __init__(self, agent: Any, fd: int, size: int):
        self.mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view: np.ndarray | None = np.frombuffer(self.mapping, np.uint8)
        self.address = int(self.view.ctypes.data)
        self.registration = agent.register_memory([(self.address, size, 0, "")], "DRAM")

    def close(self, agent: Any) -> None:
        agent.deregister_memory(self.registration)
        self.view = None  # the mapping cannot close while an array exports it
        self.mapping.close()


class NixlExporter:
    """Server side: the PS's one NIXL agent, with registered mappings of the stored versions (for
    pulls) and the registered slots of pushes in progress. The agent has no progress thread; a
    pump thread progresses it (every ``BUSY_PROGRESS_S`` while transfers may run, else every
    ``IDLE_PROGRESS_S``), so a PS with NIXL enabled costs next to no CPU while idle. NIXL's
    agent is not thread-safe without its listener: every call into it holds ``_lock``."""

    def __init__(self, name_prefix: str):
        load_nixl()  # fail at startup, with the install hint, rather than at the first transfer
        self.name_prefix = name_prefix
        self._agent: Any = None
        self._exports: dict[int, _Export] = {}
        self._pushes: dict[str, Any] = {}  # push_id -> registration of its slot's data section
        self._busy_until = 0.0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # a transfer may start: progress often from now on
        self._pump: threading.Thread | None = None

    def _started_agent(self) -> Any:
        """Under ``_lock``: the agent, created (with its pump) on first use."""
        if self._stopped.is_set():
            raise TransportUnavailable("the parameter server is stopping")
        if self._agent is None:
            self._agent = _new_agent(self.name_prefix)
            self._pump = threading.Thread(target=self._progress_forever, name="nixl-progress", daemon=True)
            self._pump.start()
        return self._agent

    def _progress_forever(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(BUSY_PROGRESS_S if self._pushes or time.monotonic() < self._busy_until else IDLE_PROGRESS_S)
            self._wake.clear()
            with self._lock:
                if self._agent is not None and not self._stopped.is_set():
                    self._agent.get_new_notifs()  # progresses the worker: connection requests, TCP lanes

    def _details(self, agent: Any) -> dict:
        return {"agent_name": agent.name, "agent_metadata_b64": base64.b64encode(agent.get_agent_metadata()).decode()}

    def lease_details(self, version: int, fd: int, size: int) -> dict:
        with self._lock:
            agent = self._started_agent()
            if version not in self._exports:
                self._exports[version] = _Export(agent, fd, size)
            self._busy_until = time.monotonic() + BUSY_AFTER_LEASE_S
            self._wake.set()
            return {**self._details(agent), "base_address": self._exports[version].address, "size": size}

    def push_details(self, push_id: str, base_address: int, data_offset: int, size: int) -> dict:
        """Registers the data section of a push's memory slot (``size`` bytes at ``base_address +
        data_offset``; once per push, whichever part asks first) and returns what a pusher needs
        to WRITE into it."""
        with self._lock:
            agent = self._started_agent()
            if push_id not in self._pushes:
                self._pushes[push_id] = (agent.register_memory([(base_address + data_offset, size, 0, "")], "DRAM")
                                         if size else None)
            self._wake.set()
            return {**self._details(agent), "base_address": base_address, "data_offset": data_offset, "size": size}

    def release_push(self, push_id: str) -> None:
        """The push committed, was dropped or the PS stops: its slot is registered no more."""
        with self._lock:
            registration = self._pushes.pop(push_id, None)
            if registration is not None:
                self._agent.deregister_memory(registration)

    def release(self, version: int) -> None:
        with self._lock:
            export = self._exports.pop(version, None)
            if export is not None:
                export.close(self._agent)

    def registrations(self) -> dict:
        """What is registered now: versions exported for pulls, pushes open for writes."""
        with self._lock:
            return {"versions": sorted(self._exports), "pushes": len(self._pushes)}

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._pump is not None:
            self._pump.join()
        with self._lock:
            for export in self._exports.values():
                export.close(self._agent)
            self._exports.clear()
            for registration in self._pushes.values():
                if registration is not None:
                    self._agent.deregister_memory(registration)
            self._pushes.clear()


class NixlTransport(Transport):
    """Client side: one agent per client, the initiator of every transfer. A pull READs each
    chunk from the PS's registered memory; a push WRITEs each chunk into the slot while
    ``workers`` threads hash the same source bytes, and returns those checksums."""

    name = "nixl"

    def __init__(self, poll_timeout_s: float = 120.0, workers: int = 2):
        self.poll_timeout_s = poll_timeout_s
        self.workers = workers
        self._agent = _new_agent("staleflow-client")
        self._remote_metadata: dict[str, bytes] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._read_target: tuple[ByteRegions, Any] | None = None  # read_chunk's buffers and their registration

    def _remote(self, details: dict) -> str:
        name, metadata = details["agent_name"], base64.b64decode(details["agent_metadata_b64"])
        if self._remote_metadata.get(name) != metadata:
            # loading a known agent's metadata again adds its new registrations and keeps the
            # connection (measured: no second connection setup)
            self._agent.add_remote_agent(metadata)
            self._remote_metadata[name] = metadata
        return name

    def _register(self, views: Iterable[memoryview]) -> Any:
        regions = _merged_regions(views)  # registering costs more than it pins per byte: few, large
        return self._agent.register_memory(regions, "DRAM") if regions else None

    @staticmethod
    def _descriptors(views: Sequence[memoryview], remote_address: int) -> tuple[list, list]:
        local, remote = [], []
        for view in views:
            local.append((_address(view), len(view), 0))
            remote.append((remote_address, len(view), 0))
            remote_address += len(view)
        return local, remote

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        details = dict(lease.details)
        remote = self._remote(details)
        remote_base = details["base_address"] + lease.manifest.data_offset
        registration = self._register(into.views(0, lease.manifest.total_bytes))
        try:
            for chunk in lease.manifest.chunks:
                self._transfer("READ", remote, *self._descriptors(into.views(chunk.offset, chunk.length), remote_base + chunk.offset))
                yield chunk.offset, chunk.length
        finally:
            if registration is not None:
                self._agent.deregister_memory(registration)

    def read_chunk(self, lease: PullLease, chunk: ChunkSpec, into: ByteRegions) -> None:
        """READ one chunk of the lease's memory into ``into`` (a peer's copy read chunk by chunk as
        its chunks land). ``into`` is registered once, on its first chunk, until ``forget_reads``."""
        details = dict(lease.details)
        remote = self._remote(details)
        if self._read_target is None or self._read_target[0] is not into:
            self.forget_reads()
            self._read_target = (into, self._register(into.views(0, lease.manifest.total_bytes)))
        remote_base = int(details["base_address"]) + lease.manifest.data_offset
        self._transfer("READ", remote, *self._descriptors(into.views(chunk.offset, chunk.length), remote_base + chunk.offset))

    def forget_reads(self) -> None:
        """``read_chunk``'s buffers are registered no more (the pull ended: they may be freed)."""
        if self._read_target is not None:
            registration, self._read_target = self._read_target[1], None
            if registration is not None:
                self._agent.deregister_memory(registration)

    def push(self, session: PushSession, source: ByteRegions) -> dict[int, str]:
        """WRITE the session's chunks from ``source`` into the PS's slot. Returns each chunk's
        checksum over the source bytes (hashed beside the writes); the PS compares them with
        the bytes that landed."""
        if not session.chunks:
            return {}
        details = dict(session.details)
        remote = self._remote(details)
        remote_base = int(details["base_address"]) + int(details["data_offset"])
        views = {chunk.index: [(offset, source.views(offset, length)) for offset, length in chunk.spans()]
                 for chunk in session.chunks}
        registration = self._register(v for spans in views.values() for _, span_views in spans for v in span_views)
        try:
            checksums = chunk_checksums(source, session.chunks, [session.checksum_algorithm] * len(session.chunks),
                                        self._executor())
            for chunk in session.chunks:  # one transfer per chunk; a gathered chunk's ranges are its descriptors
                local: list[tuple[int, int, int]] = []
                remote_descs: list[tuple[int, int, int]] = []
                for offset, span_views in views[chunk.index]:
                    span_local, span_remote = self._descriptors(span_views, remote_base + offset)
                    local += span_local
                    remote_descs += span_remote
                self._transfer("WRITE", remote, local, remote_descs)
            return {chunk.index: checksum for chunk, checksum in zip(session.chunks, checksums, strict=True)}
        finally:
            if registration is not None:
                self._agent.deregister_memory(registration)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="nixl-hash")
        return self._pool

    def _transfer(self, operation: str, remote: str, local: list[tuple[int, int, int]],
                  remote_descs: list[tuple[int, int, int]]) -> None:
        handle = self._agent.initialize_xfer(operation, self._agent.get_xfer_descs(local, "DRAM"),
                                             self._agent.get_xfer_descs(remote_descs, "DRAM"), remote, b"")
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.poll_timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)  # also progresses this agent
            if state != "DONE":
                raise TransportUnavailable(f"NIXL {operation} with {remote} ended in state {state}")
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.forget_reads()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
