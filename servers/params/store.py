"""The parameter server's store: immutable versions in host memory, sharded pushes in progress,
pull leases, retention and background persistence. The pure rules they follow (version specs,
retention, part coverage, the records) are ``rules``; a version's folder on disk is ``files``.

Memory first: a push writes straight into a shared-memory slot (``/dev/shm``); the version becomes
visible from it as soon as every part of the push is in and verified. A background thread then
persists it to ``state_dir/versions/vNNNNNNNNNN/`` (one safetensors file plus ``manifest.json``,
written last and renamed into place; ``.staging-*`` folders are what a crash left and a restart
discards). After a crash the newest persisted versions are served again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from staleflow.config import ParamsConfig
from staleflow.errors import ErrorCode
from staleflow.servers.params.files import DATA_FILE, MANIFEST_FILE, VERSION_DIR, fsync_dir, load_version, write_atomically
from staleflow.servers.params.push import HEADER_ALIGN, PushTable, hash_chunks
from staleflow.servers.params.rules import (
    Lease,
    ParamsError,
    StoredVersion,
    parse_version_spec,
    shm_prefix,
    versions_to_drop,
)
from staleflow.transports.checksums import (
    checksum_algorithm,
)
from staleflow.transports.layout import Manifest, safetensors_header
from staleflow.transports.shm import ShmSlot, ShmSlots, host_id

log = logging.getLogger(__name__)


PERSIST_STEP = 64 << 20  # bytes a persist copies between looks at the traffic


class ParamStore:
    """Versioned storage with leases, memory first. Thread-safe; metadata under one condition
    variable, bulk copies outside it."""

    def __init__(self, config: ParamsConfig):
        self.config = config
        self.root = config.state_dir / "versions"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(config.state_dir / "params.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise OSError(f"another parameter server is using {config.state_dir}; stop it or pick another --state-dir") from None
        self.versions: dict[int, StoredVersion] = {}
        self.leases: dict[str, Lease] = {}
        self.pulls_started: dict[str, int] = {}  # by transport, since this server started
        self.active_streams = 0
        self._closed = False
        self.cond = threading.Condition()
        # pyright reads this file at its checkout path and, imported by name, at .ci/installed-layout's:
        # to it, ParamStore here and in push.py are two classes
        self.pushes = PushTable(self)  # pyright: ignore[reportArgumentType]
        self.memory = ShmSlots(config.shm_dir, shm_prefix(config.state_dir))  # the memory tier, shm pulls or not
        self.nixl = None
        if "nixl" in config.transports:
            from staleflow.transports.nixl import NixlExporter

            self.nixl = NixlExporter(f"staleflow-ps-{uuid.uuid4().hex[:8]}")
        self._to_persist: set[int] = set()
        # reference-oriented storage (``reference``): versions whose copy this store dropped while
        # holders serve them (still resolvable), copies from holders in progress, and a hook the
        # reference server sets to hear of each version that becomes visible
        self.referenced: dict[int, Manifest] = {}
        self.replicas: dict[int, StoredVersion] = {}
        self._abandoned: dict[int, StoredVersion] = {}
        self.on_visible: Callable[[Manifest], None] | None = None
        self._trash: list[Path] = []  # evicted versions' folders, deleted by the disk thread
        self._loading = threading.Lock()  # one version loaded from disk into a memory slot at a time
        self._recover()
        self._disk = threading.Thread(target=self._disk_forever, name="params-disk", daemon=True)
        self._disk.start()

    @property
    def shm(self) -> ShmSlots | None:
        """The slots, when shared-memory pulls are offered."""
        return self.memory if "shm" in self.config.transports else None

    # -- startup and shutdown

    def _recover(self) -> None:
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):  # an unfinished persist or a half-deleted version
                log.info("discarding %s", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            match = VERSION_DIR.match(entry.name)
            if not match:
                continue
            try:
                stored = load_version(entry, int(match.group(1)))
            except (OSError, ValueError) as exc:
                log.warning("discarding incomplete version in %s: %s", entry.name, exc)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            self.versions[stored.manifest.version] = stored
        with self.cond:
            self.apply_retention()
        log.info("parameter store at %s holds versions %s", self.root, sorted(self.versions) or "none")

    def close(self) -> None:
        if self._closed:
            return
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self._disk.join()
        for trash in self._trash:
            shutil.rmtree(trash, ignore_errors=True)
        with self.cond:
            self.pushes.drop_all("the parameter server stopped")
            for stored in self.versions.values():
                if stored.slot is None:
                    os.close(stored.fd)
            self.versions.clear()
            self.leases.clear()
        self.memory.close()
        if self.nixl is not None:
            self.nixl.close()
        os.close(self._lock_fd)  # releases the state directory

    # -- visibility and retention

    def publish(self, stored: StoredVersion) -> None:
        """Under the lock: a pushed version becomes visible (and is persisted in the background)."""
        version = stored.manifest.version
        self.versions[version] = stored
        if self.config.persist:
            self._to_persist.add(version)
        self.apply_retention()
        if self.on_visible is not None:
            self.on_visible(stored.manifest)
        self.cond.notify_all()

    def apply_retention(self) -> None:
        retained = [v for v, s in self.versions.items() if s.retained]
        kept = max(self.config.keep, self.config.retain or 0)
        for version in set(self.referenced) - set(sorted({*retained, *self.referenced})[-kept:]):
            del self.referenced[version]
        for version in versions_to_drop(retained, kept):
            stored = self.versions[version]
            stored.retained = False
            if stored.leases == 0:
                self._destroy(stored)

    def _destroy(self, stored: StoredVersion) -> None:
        version = stored.manifest.version
        del self.versions[version]
        self._to_persist.discard(version)
        if self.nixl is not None:
            self.nixl.release(version)
        if stored.slot is not None:
            self.memory.release(version)
        else:
            os.close(stored.fd)
        if stored.directory is not None:
            trash = self.root / f".trash-{stored.directory.name}-{uuid.uuid4().hex[:8]}"
            os.rename(stored.directory, trash)
            self._trash.append(trash)  # deleted by the disk thread (a restart removes what a crash left)
            self.cond.notify_all()
        log.info("evicted version %d", version)

    def delete_version(self, version: int) -> StoredVersion:
        """Withdraw a complete version (a bad one, or to make room): no new pulls get it, and it
        leaves memory and disk once the pulls still reading it end."""
        with self.cond:
            stored = self.versions.get(version)
            if stored is None or not stored.retained:
                raise ParamsError(ErrorCode.UNKNOWN_VERSION, f"version {version} is not kept here")
            stored.retained = False
            self._to_persist.discard(version)
            if stored.leases == 0:
                self._destroy(stored)
            self.cond.notify_all()
            log.info("version %d deleted%s", version, f" once {stored.leases} reader(s) finish" if stored.leases else "")
            return stored

    # -- persistence (off the critical path)

    def _disk_forever(self) -> None:
        """The disk work, off the critical path: persisting new versions, then deleting evicted ones."""
        while True:
            trash: Path | None = None
            stored: StoredVersion | None = None
            with self.cond:
                while not self._to_persist and not self._trash and not self._closed:
                    self.cond.wait()
                if self._closed:
                    return
                if self._to_persist:
                    version = max(self._to_persist)
                    self._to_persist.clear()  # older ones are superseded: recovery serves the newest
                    stored = self.versions.get(version)
                    if stored is None or stored.persisted:
                        continue
                    stored.leases += 1  # pinned: its slot is not reused while it is copied out
                else:
                    trash = self._trash.pop(0)
            if trash is not None:
                self._delete(trash)
                continue
            assert stored is not None  # taken to persist when there was no trash
            try:
                self._persist(stored)
            except OSError as exc:
                log.error("version %d was not persisted: %s", version, exc)
            finally:
                with self.cond:
                    stored.leases -= 1
                    if stored.leases == 0 and not stored.retained and version in self.versions:
                        self._destroy(stored)
                    self.cond.notify_all()

    def _persist(self, stored: StoredVersion) -> None:
        started = time.monotonic()
        version = stored.manifest.version
        directory = self.root / f".staging-v{version:010d}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        try:
            fd = os.open(directory / DATA_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                copied, budget = 0, self.config.persist_yield_s
                while copied < stored.file_size:
                    budget = self._yield_to_traffic(budget)
                    n = os.sendfile(fd, stored.fd, copied, min(PERSIST_STEP, stored.file_size - copied))
                    if n == 0:
                        raise OSError(f"version {version} ended at byte {copied} of {stored.file_size}")
                    copied += n
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            write_atomically(directory / MANIFEST_FILE, json.dumps(stored.manifest.to_json()).encode(), self.config.fsync)
            final = self.root / f"v{version:010d}"
            os.rename(directory, final)
            if self.config.fsync:
                fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        with self.cond:
            stored.directory, stored.persisted = final, True
            stored.persist_seconds = time.monotonic() - started
            stored.persist_yielded_seconds = self.config.persist_yield_s - budget
        log.info("version %d persisted in %.3f s (%.3f s of it yielding to pushes and pulls)", version,
                 stored.persist_seconds, stored.persist_yielded_seconds)

    def _delete(self, trash: Path) -> None:
        """Delete an evicted version's folder, its data file a step at a time: freeing a GB file
        takes ~0.2 s of kernel time, which a push or pull on the same cores would wait for."""
        budget = self.config.persist_yield_s
        try:
            with open(trash / DATA_FILE, "r+b") as data:
                size = os.fstat(data.fileno()).st_size
                while size > 0:
                    budget = self._yield_to_traffic(budget)
                    size = max(0, size - PERSIST_STEP)
                    os.ftruncate(data.fileno(), size)
        except OSError:
            pass  # already gone, or not a version folder: removed whole below
        shutil.rmtree(trash, ignore_errors=True)

    def _traffic(self) -> bool:
        """Pushes or pulls in flight: a persist competes with them for memory bandwidth and cores."""
        return bool(self.pushes.pending) or bool(self.leases) or self.active_streams > 0

    def _yield_to_traffic(self, budget: float) -> float:
        """Wait while pushes or pulls are in flight, at most ``budget`` seconds; returns what is
        left of it (a PS that is never quiet still persists every version, ``budget`` later)."""
        if budget <= 0:
            return 0.0
        deadline = time.monotonic() + budget
        with self.cond:
            while self._traffic() and not self._closed and time.monotonic() < deadline:
                self.cond.wait(deadline - time.monotonic())
        return max(0.0, deadline - time.monotonic())

    def wait_persisted(self, version: int, timeout_s: float) -> bool:
        """True once ``version`` is on disk (tests, benchmarks, a clean stop)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                stored = self.versions.get(version)
                if stored is not None and stored.persisted:
                    return True
                if stored is None or time.monotonic() >= deadline:
                    return False
                self.cond.wait(min(1.0, deadline - time.monotonic()))

    # -- pull

    def _resolve(self, spec: str) -> tuple[int | None, str]:
        """(version or None, why not) for a version spec, among the retained versions."""
        kind, number = parse_version_spec(spec)
        retained = sorted({*(v for v, s in self.versions.items() if s.retained), *self.referenced})
        if kind == "exact":
            version = number
        elif not retained:
            return None, "no complete version yet"
        else:
            version = retained[-1] - number
        stored = self.versions.get(version)
        if (stored is not None and stored.retained) or version in self.referenced:
            return version, ""
        if stored is not None or (retained and version < retained[0]):
            return None, f"version {version} is not kept any more (kept: {retained})"
        if version in self.pushes.pending:
            return None, f"version {version} is being pushed"
        return None, f"version {version} has not been pushed (kept: {retained})"

    def acquire(self, spec: str, transport: str, wait_s: float = 0.0) -> tuple[Lease, StoredVersion]:
        """A lease on a complete version: it is not deleted until the lease ends. Waits up to
        ``wait_s`` for a version that is being pushed or not pushed yet."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                self.sweep_locked()
                version, why = self._resolve(spec)
                if version is not None:
                    break
                kind, number = parse_version_spec(spec)
                newest = max(self.versions, default=-1)
                can_appear = (kind == "latest" and not self.versions) or (kind == "exact" and number > newest)
                remaining = deadline - time.monotonic()
                if not can_appear or remaining <= 0:
                    code = ErrorCode.VERSION_BEING_PUSHED if "being pushed" in why else ErrorCode.UNKNOWN_VERSION
                    hint = "; pass wait_s to wait for it" if can_appear else ""
                    raise ParamsError(code, why + hint)
                self.cond.wait(min(remaining, 1.0))
            stored = self._own_copy(version)
            return self._lease_on(stored, transport), stored

    def _lease_on(self, stored: StoredVersion, transport: str) -> Lease:
        """Under the lock: a new lease pinning ``stored`` (``transport``: what it is counted as)."""
        stored.leases += 1
        lease = Lease(uuid.uuid4().hex, stored.manifest.version, transport, time.monotonic() + self.config.lease_ttl_s)
        self.leases[lease.lease_id] = lease
        self.pulls_started[transport] = self.pulls_started.get(transport, 0) + 1
        return lease

    def acquire_peer(self, version: int, transport: str) -> tuple[Lease, StoredVersion]:
        """A lease for a peer reading this store's copy of ``version`` straight out of its memory
        (shm, nixl), a copy still being pulled from holders included (``held`` says which chunks
        landed; ``wait_chunk`` waits for the others). While it is open the copy's slot is not
        reused, even once the version is unpublished or the copy given up."""
        if transport not in ("shm", "nixl") or transport not in self.config.transports:
            raise ParamsError(ErrorCode.TRANSPORT_DISABLED, f"peers read this copy over {transport!r} only where it is "
                                                            f"enabled here (enabled: {', '.join(self.config.transports)}); "
                                                            "read its chunks over http")
        with self.cond:
            self.sweep_locked()
            stored = self.versions.get(version)
            if stored is None or not stored.retained:
                stored = self.replicas.get(version)
            if stored is None:
                raise ParamsError(ErrorCode.UNKNOWN_VERSION, f"version {version} is not held here (unpublished, or never "
                                                             "pulled); ask the reference server for another source")
            return self._lease_on(stored, f"peer-{transport}"), stored

    def transport_details(self, stored: StoredVersion, transport: str) -> dict:
        """What a puller needs to read ``stored`` over ``transport`` (a lease holds it meanwhile)."""
        if transport == "shm":
            slot = self.memory_slot(stored)  # a version recovered from disk is loaded on demand
            # the stamp and generation let the puller check the slot was not reused under it (see shm.py)
            return {"path": str(slot.path), "size": slot.size, "host_id": host_id(), "stamp_path": str(slot.stamp_path),
                    "generation": slot.generation}
        if transport == "nixl":
            assert self.nixl is not None
            return self.nixl.lease_details(stored.manifest.version, stored.fd, stored.file_size)
        return {}

    def landed_through(self, stored: StoredVersion, index: int) -> int:
        """The end of the run of landed chunks from ``index`` on (all of them for a complete copy)."""
        total = len(stored.manifest.chunks)
        with self.cond:
            held = stored.held
            if held is None:
                return total
            end = index
            while end < total and end in held:
                end += 1
            return end

    def release(self, lease_id: str) -> bool:
        with self.cond:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unpin(lease.version)
            self.cond.notify_all()  # a persist may be waiting for the pulls to end
            return True

    def _unpin(self, version: int) -> None:
        stored = self.versions.get(version) or self.replicas.get(version) or self._abandoned.get(version)
        if stored is None:
            return
        stored.leases -= 1
        if stored.leases == 0 and stored.abandoned:
            self._drop_replica(stored)
        elif stored.leases == 0 and not stored.retained and stored.held is None:
            self._destroy(stored)

    def sweep_locked(self) -> None:
        """Under the lock: lapsed leases end and idle pushes are dropped."""
        now = time.monotonic()
        for lease in [lease for lease in self.leases.values() if lease.expires_at < now]:
            log.warning("pull lease %s on version %d lapsed", lease.lease_id, lease.version)
            del self.leases[lease.lease_id]
            self._unpin(lease.version)
        self.pushes.drop_idle(now)

    def sweep(self) -> None:
        with self.cond:
            self.sweep_locked()

    def open_range(self, version: int, lease_id: str | None) -> tuple[int, StoredVersion]:
        """A private fd (dup) on a stored version, for one stream, which pins the version until
        ``stream_done``. With a lease: renews it."""
        with self.cond:
            if lease_id is not None:
                lease = self.leases.get(lease_id)
                if lease is None:
                    raise ParamsError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id!r} is unknown or lapsed; open a new pull")
                if lease.version != version:
                    raise ParamsError(ErrorCode.LEASE_MISMATCH, f"lease {lease_id!r} is for version {lease.version}, not {version}")
                lease.expires_at = time.monotonic() + self.config.lease_ttl_s
            stored = self.versions.get(version) or self.replicas.get(version)
            if stored is None or (lease_id is None and not stored.retained):
                raise ParamsError(ErrorCode.UNKNOWN_VERSION, f"version {version} is not stored"
                                  + ("" if stored is None else " any more (unpublished or evicted)"))
            self.active_streams += 1
            stored.leases += 1
            return os.dup(stored.fd), stored

    def stream_done(self, stored: StoredVersion) -> None:
        with self.cond:
            self.active_streams -= 1
            self._unpin(stored.manifest.version)
            self.cond.notify_all()

    def resolve_stored(self, spec: str) -> StoredVersion:
        with self.cond:
            return self._own_copy(self._resolved(spec))

    def resolve_manifest(self, spec: str) -> Manifest:
        """The manifest of a version this store holds, or whose holders serve it."""
        with self.cond:
            version = self._resolved(spec)
            stored = self.versions.get(version)
            return stored.manifest if stored is not None and stored.retained else self.referenced[version]

    def _resolved(self, spec: str) -> int:
        version, why = self._resolve(spec)
        if version is None:
            raise ParamsError(ErrorCode.VERSION_BEING_PUSHED if "being pushed" in why else ErrorCode.UNKNOWN_VERSION, why)
        return version

    def _own_copy(self, version: int) -> StoredVersion:
        stored = self.versions.get(version)
        if stored is None or not stored.retained:
            raise ParamsError(ErrorCode.VERSION_HELD_BY_PEERS, f"version {version} is served by its holders, not by this "
                                                               "parameter server: pull it with sources='ros'")
        return stored

    def memory_slot(self, stored: StoredVersion) -> ShmSlot:
        """The version's memory slot; a version recovered from disk is loaded into one first, and
        its chunks are checked against their checksums as they land there: shm pullers check only
        the slot's generation by default, so bytes enter a slot verified (as pushed bytes do)."""
        if stored.slot is not None:
            return stored.slot
        with self._loading:  # a second puller of the same version waits here; it never reads a half-loaded slot
            if stored.slot is not None:
                return stored.slot
            version = stored.manifest.version
            try:
                slot = self.memory.publish(version, stored.fd, stored.file_size)
            except (OSError, ValueError) as exc:
                raise ParamsError(ErrorCode.TRANSPORT_UNAVAILABLE,
                                  f"cannot load version {version} into shared memory: {exc}; pull over http") from None
            self._check_loaded(stored, slot)
            with self.cond:
                if stored.slot is None and version in self.versions:
                    assert slot.fd is not None
                    os.close(stored.fd)
                    stored.slot, stored.fd = slot, slot.fd
            return slot

    def _check_loaded(self, stored: StoredVersion, slot: ShmSlot) -> None:
        """Hash a version loaded from disk in its slot; a damaged one leaves no slot behind."""
        manifest = stored.manifest
        chunks = [c for c in manifest.chunks if c.checksum]
        landed = hash_chunks(slot, manifest.data_offset, manifest.total_bytes, chunks,
                              [checksum_algorithm(c.checksum or "") for c in chunks], "params-load")
        damaged = [c.index for c, actual in zip(chunks, landed, strict=True) if actual != c.checksum]
        if damaged:
            self.memory.release(manifest.version, discard=True)
            raise ParamsError(ErrorCode.CHECKSUM_MISMATCH,
                              f"version {manifest.version} on disk does not match its checksums (chunks {damaged[:5]}): the "
                              f"persisted copy is damaged; delete it and push the version again")

    def metrics(self) -> list:
        """Prometheus view of the store, read at scrape time."""
        from staleflow import metrics as m

        with self.cond:
            retained = {v: s for v, s in self.versions.items() if s.retained}
            return [
                m.PARAMS_LATEST_VERSION.value(max(retained, default=-1)),
                m.PARAMS_VERSIONS.value(len(retained)),
                m.PARAMS_STORED_BYTES.value(sum(s.file_size for s in self.versions.values())),
                m.PARAMS_PUSHES.value(self.pushes.committed),
                m.PARAMS_PULLS.family([([t], n) for t, n in sorted(self.pulls_started.items())]),
                m.PARAMS_ACTIVE_PULLS.value(len(self.leases)),
            ]

    def describe(self) -> dict:
        with self.cond:
            self.sweep_locked()
            return {
                "keep": self.config.keep,
                # a version whose copy this store dropped for its holders (ROS) is still its latest
                "latest": max((*(v for v, s in self.versions.items() if s.retained), *self.referenced), default=None),
                "versions": [s.summary() for _, s in sorted(self.versions.items())],
                "referenced": sorted(self.referenced),
                "pushes": [p.progress() for _, p in sorted(self.pushes.pending.items())],
                "readers": {"leases": len(self.leases), "streams": self.active_streams},
                "writers": len(self.pushes.pending),
                "transports": list(self.config.transports),
                "persist": self.config.persist,
                "shm": self.memory.usage(),
            }



    # -- copies from holders (reference-oriented storage)

    def drop_copy(self, version: int) -> None:
        """Drop this store's copy of ``version`` while holders serve it: it stays resolvable
        (``referenced``), its bytes go once the reads in flight end."""
        with self.cond:
            stored = self.versions.get(version)
            if stored is None or not stored.retained:
                return
            self.referenced[version] = stored.manifest
            stored.retained = False
            self._to_persist.discard(version)
            if stored.leases == 0:
                self._destroy(stored)
            log.info("dropped the copy of version %d: its holders serve it", version)

    def begin_replica(self, manifest: Manifest) -> StoredVersion:
        """A memory slot for a copy of ``manifest``'s version taken from its holders, chunk by
        chunk; a chunk is served (pipeline replication) once ``replica_landed`` says it is verified."""
        version = manifest.version
        header = safetensors_header(manifest.tensors, {"format": "pt", **manifest.metadata,
                                                       "staleflow_version": str(version)}, HEADER_ALIGN)
        with self.cond:
            if version in self.replicas or version in self.versions or version in self._abandoned:
                raise ParamsError(ErrorCode.VERSION_EXISTS, f"version {version} is held or being copied here already "
                                                            "(or its last copy is still being read)")
            if len(header) != manifest.data_offset:
                raise ParamsError(ErrorCode.INVALID_FORMAT, f"version {version}'s header is {len(header)} bytes here, "
                                                            f"{manifest.data_offset} in its manifest")
            try:
                slot = self.memory.reserve(version, manifest.data_offset + manifest.total_bytes)
            except OSError as exc:
                raise ParamsError(ErrorCode.MEMORY_FULL, f"no room for version {version}: {exc}") from None
            assert slot.fd is not None
            os.pwrite(slot.fd, header, 0)
            stored = StoredVersion(manifest, slot.fd, manifest.data_offset + manifest.total_bytes, slot=slot, held=set())
            self.replicas[version] = stored
            return stored

    def replica_landed(self, stored: StoredVersion, index: int) -> None:
        with self.cond:
            assert stored.held is not None
            stored.held.add(index)
            self.cond.notify_all()

    def finish_replica(self, stored: StoredVersion) -> None:
        """Every chunk landed verified: the copy is a version of this store like a pushed one."""
        with self.cond:
            version = stored.manifest.version
            assert stored.held is not None and len(stored.held) == len(stored.manifest.chunks)
            del self.replicas[version]
            stored.held = None
            assert stored.slot is not None
            stored.slot.visible = True
            stored.visible_at_monotonic = time.monotonic()
            self.referenced.pop(version, None)
            self.publish(stored)

    def abandon_replica(self, stored: StoredVersion) -> None:
        with self.cond:
            version = stored.manifest.version
            if self.replicas.get(version) is not stored:
                return
            del self.replicas[version]
            stored.abandoned = True
            self.cond.notify_all()
            if stored.leases == 0:
                self._drop_replica(stored)
            else:
                self._abandoned[version] = stored

    def _drop_replica(self, stored: StoredVersion) -> None:
        self._abandoned.pop(stored.manifest.version, None)
        if self.nixl is not None:  # its export maps the discarded slot: a later copy of the version maps its own
            self.nixl.release(stored.manifest.version)
        self.memory.release(stored.manifest.version, discard=True)

    def wait_chunk(self, stored: StoredVersion, index: int, timeout_s: float) -> None:
        """Until chunk ``index`` of a copy in progress has landed (pipeline replication)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while stored.held is not None and index not in stored.held:
                left = deadline - time.monotonic()
                if stored.abandoned or left <= 0:
                    raise ParamsError(ErrorCode.VERSION_UNAVAILABLE,
                                      f"chunk {index} of version {stored.manifest.version} did not land here "
                                      f"({'the copy was given up' if stored.abandoned else f'in {timeout_s:g} s'}); "
                                      "ask the reference server for another source")
                self.cond.wait(min(left, 1.0))
