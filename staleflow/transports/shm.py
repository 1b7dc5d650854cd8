"""The ``shm`` transport: instances on the PS's host read a version straight out of shared memory.

Server side, :class:`ShmSlots` keeps each retained version as a whole safetensors file in a
POSIX shared-memory segment (a file under ``/dev/shm``; ``shm_open`` / ``SharedMemory(name)``
open the same object). A pull lease hands out the segment path; the puller maps it and copies the
tensors out, so a pull is one memcpy.

Segments are *slots* that get reused: when a version is evicted and no one reads it, its slot
takes the next version, and keeps its size when the model's size did not change. A puller caches
its mapping of each slot, so the page tables stay populated across versions. Mapping a fresh
segment costs one page fault per 4 KiB page (here: 5 GB/s for a 1 GB copy instead of 17 GB/s
through a populated mapping). A slot is never rewritten while a lease on its version is open:
that is the read-write rule of the PS, and the chunk checksums check it on the puller's side.

Memory: (keep + 1) x model size of shared memory, counted against ``/dev/shm``'s size.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from staleflow.transports.base import ByteRegions, PullLease, Transport, TransportUnavailable, pieces_of

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # copy step: small enough that the verifier hashes it while it is in cache (measured best)


def host_id() -> str:
    """Identifies this boot of this machine: shared memory is only shared under the same one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"{os.uname().nodename}"


@dataclass
class ShmSlot:
    path: Path
    size: int
    version: int | None = None


class ShmSlots:
    """Server side: versions published into reusable shared-memory segments."""

    def __init__(self, directory: Path, prefix: str, spare: int = 1):
        self.directory = directory
        self.prefix = prefix
        self.spare = spare
        self._slots: list[ShmSlot] = []
        self._lock = threading.Lock()
        self._next_id = 0
        if not directory.is_dir():
            raise TransportUnavailable(f"shared-memory directory {directory} does not exist")
        self.remove_stale()

    def remove_stale(self) -> None:
        """Segments left by a previous process of this PS (same state directory): unlink them."""
        for path in self.directory.glob(f"{self.prefix}-slot*"):
            path.unlink(missing_ok=True)

    def publish(self, version: int, source_fd: int, size: int) -> ShmSlot:
        """Copy ``size`` bytes of ``source_fd`` (a stored version file) into a free slot."""
        with self._lock:
            for slot in self._slots:
                if slot.version == version:
                    return slot
            slot = self._free_slot(size)
            fd = os.open(slot.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                copied = 0
                while copied < size:
                    n = os.sendfile(fd, source_fd, copied, size - copied)
                    if n == 0:
                        raise OSError(f"stored version {version} is shorter than {size} bytes")
                    copied += n
            except OSError:
                slot.path.unlink(missing_ok=True)
                self._slots.remove(slot)
                raise
            finally:
                os.close(fd)
            slot.size, slot.version = size, version
            return slot

    def _free_slot(self, size: int) -> ShmSlot:
        free = [s for s in self._slots if s.version is None]
        for slot in free:
            if slot.size == size:  # the pullers' mappings of it stay valid
                return slot
        if free:
            return free[0]
        slot = ShmSlot(self.directory / f"{self.prefix}-slot{self._next_id}", 0)
        self._next_id += 1
        self._slots.append(slot)
        return slot

    def slot_of(self, version: int) -> ShmSlot | None:
        with self._lock:
            return next((s for s in self._slots if s.version == version), None)

    def release(self, version: int) -> None:
        """The version is gone and unread: its slot may take another one."""
        with self._lock:
            for slot in self._slots:
                if slot.version == version:
                    slot.version = None
            free = [s for s in self._slots if s.version is None]
            for slot in free[self.spare:]:
                slot.path.unlink(missing_ok=True)
                self._slots.remove(slot)

    def usage(self) -> dict:
        with self._lock:
            return {"slots": len(self._slots), "bytes": sum(s.size for s in self._slots),
                    "versions": sorted(s.version for s in self._slots if s.version is not None)}

    def close(self) -> None:
        with self._lock:
            for slot in self._slots:
                slot.path.unlink(missing_ok=True)
            self._slots.clear()


class _Mapping:
    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.identity = (st.st_dev, st.st_ino, st.st_size)
            self.map = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if st.st_size else None
        finally:
            os.close(fd)
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self.map is not None:
            self.map.close()


class ShmTransport(Transport):
    """Client side: copy out of the PS's segment; mappings are cached per slot (see module doc)."""

    name = "shm"

    def __init__(self) -> None:
        self._mappings: dict[str, _Mapping] = {}
        self._lock = threading.Lock()

    def _mapping(self, path: str) -> _Mapping:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise TransportUnavailable(f"shared-memory segment {path} is not on this host; pull over 'http'") from None
        with self._lock:
            for gone in [p for p in self._mappings if p != path and not os.path.exists(p)]:
                self._mappings.pop(gone).close()  # a trimmed slot: let its memory go
            cached = self._mappings.get(path)
            if cached is not None and cached.identity == (st.st_dev, st.st_ino, st.st_size):
                return cached
            if cached is not None:
                cached.close()
            mapping = self._mappings[path] = _Mapping(path)
            return mapping

    def pull(self, lease: PullLease, into: ByteRegions) -> Iterator[tuple[int, int]]:
        details = lease.details
        if details.get("host_id") != host_id():
            raise TransportUnavailable("the parameter server runs on another host (or boot); pull over 'http'")
        source = self._mapping(details["path"]).view
        base = lease.manifest.data_offset
        if len(source) < base + lease.manifest.total_bytes:
            raise TransportUnavailable(f"segment {details['path']} is shorter than version {lease.manifest.version}")
        for chunk in lease.manifest.chunks:
            for offset, length in pieces_of(chunk, PIECE_BYTES):
                position = base + offset
                for view in into.views(offset, length):
                    view[:] = source[position:position + len(view)]
                    position += len(view)
                yield offset, length

    def close(self) -> None:
        with self._lock:
            for mapping in self._mappings.values():
                mapping.close()
            self._mappings.clear()
