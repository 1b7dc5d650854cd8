"""The ``nixl`` transport: the puller READs a version straight out of the PS's memory with NIXL
(UCX backend), the library the paper's PS uses (Appendix A). Optional: ``pip install
staleflow[nixl]``; NIXL's Python API imports torch, so install ``torch==2.13.0`` first.

Server side, :class:`NixlExporter` maps each stored version file and registers the mapping with
a NIXL agent; a pull lease carries the agent's metadata (with the memory keys) and the base
address. Client side, :class:`NixlTransport` registers the destination buffers and issues one
READ per chunk. Between processes on one host UCX picks its ``cma`` zero-copy path; across hosts,
RDMA or TCP.

On this project's 2-core CPU machines NIXL measured 3-7 GB/s (dependencies-measured.md §2.3),
below ``shm``; its point is the same API on GPU/RDMA deployments.
"""

from __future__ import annotations

import base64
import mmap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from staleflow.transports.base import ByteRegions, PullLease, Transport, TransportUnavailable

INSTALL_HINT = "install the optional extra: pip install torch==2.13.0 'staleflow[nixl]'"


def load_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config), or TransportUnavailable saying how to get them."""
    errors = []
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError as exc:  # also raised by a broken native library
            errors.append(f"{module}: {exc}")
    raise TransportUnavailable(f"NIXL is not importable here ({'; '.join(errors)}); {INSTALL_HINT}")


def nixl_available() -> tuple[bool, str]:
    try:
        load_nixl()
    except TransportUnavailable as exc:
        return False, str(exc)
    return True, ""


def _new_agent(prefix: str) -> Any:
    agent_cls, config_cls = load_nixl()
    return agent_cls(f"{prefix}-{uuid.uuid4().hex[:8]}", config_cls(backends=["UCX"]))


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


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
    """Server side: registered mappings of the stored versions, one NIXL agent."""

    def __init__(self, name_prefix: str):
        load_nixl()  # fail at startup, with the install hint, rather than at the first pull
        self.name_prefix = name_prefix
        self._agent: Any = None
        self._exports: dict[int, _Export] = {}
        self._lock = threading.Lock()

    def lease_details(self, version: int, fd: int, size: int) -> dict:
        with self._lock:
            if self._agent is None:
                self._agent = _new_agent(self.name_prefix)
            if version not in self._exports:
                self._exports[version] = _Export(self._agent, fd, size)
            return {
                "agent_name": self._agent.name,
                "agent_metadata_b64": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "base_address": self._exports[version].address,
                "size": size,
            }

    def release(self, version: int) -> None:
        with self._lock:
            export = self._exports.pop(version, None)
            if export is not None:
                export.close(self._agent)

    def close(self) -> None:
        with self._lock:
            for export in self._exports.values():
                export.close(self._agent)
            self._exports.clear()


class NixlTransport(Transport):
    """Client side: one agent per client; each chunk is one READ from the PS's registered memory."""

    name = "nixl"

    def __init__(self, poll_timeout_s: float = 120.0):
        self.poll_timeout_s = poll_timeout_s
        self._agent = _new_agent("staleflow-puller")
        self._remote_metadata: dict[str, bytes] = {}

    def _remote(self, details: dict) -> str:
        name, metadata = details["agent_name"], base64.b64decode(details["agent_metadata_b64"])
        if self._remote_metadata.get(name) != metadata:  # new registrations change the metadata
            if name in self._remote_metadata:
                self._agent.remove_remote_agent(name)
            self._agent.add_remote_agent(metadata)
            self._remote_metadata[name] = metadata
        return name

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        details = dict(lease.details)
        remote = self._remote(details)
        remote_base = details["base_address"] + lease.manifest.data_offset
        whole = into.views(0, lease.manifest.total_bytes)
        # one registration for the whole destination: registering costs more than it pins per byte
        registration = self._agent.register_memory([(_address(v), len(v), 0, "") for v in whole], "DRAM") if whole else None
        try:
            for chunk in lease.manifest.chunks:
                local, remote_descs, offset = [], [], chunk.offset
                for view in into.views(chunk.offset, chunk.length):
                    local.append((_address(view), len(view), 0))
                    remote_descs.append((remote_base + offset, len(view), 0))
                    offset += len(view)
                self._read(remote, local, remote_descs)
                yield chunk.offset, chunk.length
        finally:
            if registration is not None:
                self._agent.deregister_memory(registration)

    def _read(self, remote: str, local: list[tuple[int, int, int]], remote_descs: list[tuple[int, int, int]]) -> None:
        handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                             self._agent.get_xfer_descs(remote_descs, "DRAM"), remote, b"")
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self.poll_timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportUnavailable(f"NIXL READ from {remote} ended in state {state}")
        finally:
            self._agent.release_xfer_handle(handle)
