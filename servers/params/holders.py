"""Reference-oriented storage in the parameter server's processes (the rules are ``reference``):

* ``ReferenceServer``: the job's parameter server as the reference server. It records holders
  (soft state, rebuilt from their heartbeats after a restart), names each chunk's sources, drops
  its own copy of a retained version once enough non-spot holders hold it and takes a copy back
  from a holder when too few do, and lets an unpublish finish only once that is safe.
* ``HolderAgent``: a parameter server that is a holder (``holder_of``: an instance's own store, a
  relay). It pulls versions from their holders into its store chunk by chunk, serving each chunk
  to other pullers once it landed verified (pipeline replication), heartbeats what it holds, and
  unpublishes a version at the reference server before its store lets go of those buffers.

Both move bytes with the library's ``PeerTransport`` into a copy in progress of the store
(``ParamStore.begin_replica``), which the store's data plane serves as any version.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from staleflow.api.base import ServiceError
from staleflow.api.params import ChunkSource
from staleflow.api.params import ParamsRoutes as API
from staleflow.config import ParamsConfig
from staleflow.errors import ErrorCode
from staleflow.servers.params.reference import PS, ReferenceError, ReferenceTable
from staleflow.servers.params.rules import StoredVersion
from staleflow.servers.params.store import ParamStore
from staleflow.transports.base import PullLease
from staleflow.transports.client import ParamsClient
from staleflow.transports.layout import Manifest
from staleflow.transports.peers import PeerTransport, reference_sources
from staleflow.transports.regions import ByteRegions
from staleflow.transports.shm import host_id

log = logging.getLogger(__name__)


def copy_into(store: ParamStore, manifest: Manifest, transport: PeerTransport) -> StoredVersion:
    """Pull ``manifest``'s version through ``transport`` into a copy in ``store``, each chunk
    served from the moment it is verified; the copy is a visible version of the store at the end
    (given up, and its memory freed once its readers end, when the pull fails)."""
    stored = store.begin_replica(manifest)
    assert stored.slot is not None and stored.slot.mapping is not None
    data = np.frombuffer(stored.slot.mapping, np.uint8)[manifest.data_offset:manifest.data_offset + manifest.total_bytes]
    transport.on_chunk = lambda index: store.replica_landed(stored, index)
    try:
        for _ in transport.pull_verified(PullLease(f"copy-{manifest.version}", manifest, "ros"), ByteRegions.flat(data)):
            pass
    except BaseException:
        store.abandon_replica(stored)
        raise
    finally:
        del data
    store.finish_replica(stored)
    return stored


def advertised_url(host: str, port: int) -> str:
    """The URL other hosts reach a server bound to ``host`` at."""
    name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://[{name}]:{port}" if ":" in name else f"http://{name}:{port}"


class ReferenceServer:
    """The reference rules over ``store``'s versions, under the store's lock; a thread applies
    retention (expiry, drops, copies back) every quarter of the holders' ttl, or when woken."""

    def __init__(self, store: ParamStore, config: ParamsConfig, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.config, self.token, self.clock = store, config, token, clock
        self.cond = store.cond
        self.table = ReferenceTable(config.retained_versions(), config.retain_replicas, config.holder_ttl_s)
        self.copies_back: list[int] = []  # versions copied back from holders (in order)
        self.withdrawn: set[int] = set()  # versions deleted while only holders held them
        with self.cond:
            for version, stored in store.versions.items():
                if stored.retained:
                    self.table.known(version, len(stored.manifest.chunks), ps_copy=True)
            store.on_visible = self._visible
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._retain_forever, name="params-retention", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)
        with self.cond:
            self.store.on_visible = None

    def _visible(self, manifest: Manifest) -> None:  # under the store's lock
        self.table.known(manifest.version, len(manifest.chunks), ps_copy=True)
        self._wake.set()

    # -- the routes' work

    def heartbeat(self, holder_id: str, url: str, host: str, zone: str, spot: bool,
                  holdings: dict[int, list[int] | None], transports: list[str]) -> dict:
        with self.cond:
            self.table.heartbeat(holder_id, url, host, zone, spot, holdings, self.clock(), transports)
            self.cond.notify_all()
            missing = sorted(v for v, c in holdings.items()
                             if c is None and v not in self.table.chunk_counts and v not in self.withdrawn)
        self._wake.set()
        return {"holder_id": holder_id, "ttl_s": self.config.holder_ttl_s, "missing": missing}

    def publish(self, holder_id: str, version: int, chunks: list[int] | None, manifest: dict | None) -> dict:
        with self.cond:
            if manifest is not None and version not in self.table.chunk_counts:
                # a restarted reference server learns the versions it lost from their holders
                known = Manifest.from_json(manifest)
                if known.version != version:
                    raise ReferenceError(ErrorCode.INVALID_FORMAT, f"a manifest of version {known.version} published as {version}")
                self.store.referenced[version] = known
                self.table.known(version, len(known.chunks), ps_copy=False)
                self.store.apply_retention()
            self.table.publish(holder_id, version, chunks, self.clock())
            self.cond.notify_all()
        self._wake.set()
        return {"holder_id": holder_id, "ttl_s": self.config.holder_ttl_s}

    def sources(self, version: int, puller: str, chunk: int, host: str, zone: str, exclude: list[str],
                failed: list[str], held: list[int] | None, count: int = 1) -> dict:
        with self.cond:
            now = self.clock()
            if failed:
                self.table.report_failed(failed)
                self._wake.set()  # fewer trusted holders: a copy back may be due
            if held is not None and puller in self.table.holders:
                self.table.publish(puller, version, held, now)
            found = self.table.sources(version, chunk, puller, host, zone, now, exclude, count)
        return {"version": version, "chunk": chunk,
                "sources": [{"holder_id": s.holder_id, "url": s.url, "has_chunk": s.has_chunk, "tier": s.tier,
                             "transports": list(s.transports)} for s in found]}

    def release(self, puller: str) -> dict:
        with self.cond:
            released = puller in self.table.assigned
            self.table.release(puller)
        return {"puller": puller, "released": released}

    def unpublish(self, holder_id: str, version: int, wait_s: float) -> dict:
        """Withdraw at once, then return once dropping the holder's copy keeps the version
        available (the PS takes a copy back first when it must)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            self.table.withdraw(holder_id, version)
            self._wake.set()
            while not self.table.unpublish_safe(holder_id, version, self.clock()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReferenceError(ErrorCode.RETENTION_PENDING,
                                         f"version {version} is retained and {holder_id} holds its last copy: the parameter "
                                         "server is taking a copy back; unpublish again (keep serving meanwhile)")
                self.cond.wait(min(left, 0.5))
            self.table.finish_unpublish(holder_id, version)
        return {"holder_id": holder_id, "version": version, "unpublished": True}

    def withdraw(self, version: int) -> bool:
        """Withdraw a version whose copy this server dropped (only holders hold it): nobody is sent
        to a holder for it any more, and heartbeats do not bring it back. False: not such a version."""
        with self.cond:
            stored = self.store.versions.get(version)
            if version not in self.store.referenced or (stored is not None and stored.retained):
                return False
            del self.store.referenced[version]
            self.table.forget(version)
            self.withdrawn.add(version)
            return True

    def deleted(self, version: int) -> None:
        """``version`` was deleted from this store: it leaves the retained versions (it no longer
        holds a newer one out of them), and holders' heartbeats do not bring it back."""
        with self.cond:
            self.table.forget(version)
            self.withdrawn.add(version)

    def describe(self) -> dict:
        with self.cond:
            return self.table.describe(self.clock())

    # -- retention

    def _retain_forever(self) -> None:
        period = self.config.holder_ttl_s / 4
        while not self._stop.is_set():
            self._wake.wait(period)
            self._wake.clear()
            try:
                self.retain_once()
            except Exception:  # a copy back that failed is planned again next round
                log.exception("retention round failed")

    def retain_once(self) -> None:
        """Expire lapsed holders, drop the copies enough holders hold, copy back the ones too few do."""
        with self.cond:
            now = self.clock()
            gone = self.table.expire(now)
            if gone:
                log.warning("holders %s missed their heartbeats: declared failed", gone)
            plan = self.table.plan(now)
            for version in plan.drop:
                self.store.drop_copy(version)
                self.table.ps_copy(version, False)
            for version in plan.forget:
                self.table.forget(version)
            donors = {v: [(h, self.table.holders[h].url) for h in hs] for v, hs in plan.copy_back.items()}
            self.cond.notify_all()
        for version, holders in donors.items():
            self._copy_back(version, holders)

    def _copy_back(self, version: int, donors: list[tuple[str, str]]) -> None:
        with self.cond:
            if version in self.store.versions or version in self.store.replicas:
                return
            manifest = self.store.referenced.get(version)
        if manifest is None:
            return

        def ask(v: int, chunk: object, count: int, exclude: object, failed: object, held: object) -> list[ChunkSource]:
            return [ChunkSource(holder_id=h, url=url, has_chunk=True, tier="other") for h, url in donors
                    if h not in exclude]  # type: ignore[operator]

        transport = PeerTransport(ask, None, headers=_bearer(self.token))
        try:
            copy_into(self.store, manifest, transport)
        except (ServiceError, OSError, ConnectionError) as exc:
            log.warning("copying version %d back from %s failed: %s", version, [h for h, _ in donors], exc)
            return
        finally:
            transport.close()
        self.copies_back.append(version)
        log.info("took a copy of version %d back from its holders %s", version, transport.fetched)
        with self.cond:
            self.cond.notify_all()  # an unpublish may be waiting for it


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class HolderAgent:
    """Makes ``store`` a holder of the reference server at ``config.holder_of``: heartbeats,
    pulls from peers, unpublishes before its store drops a version. ``follow``: pull each new
    version the reference server knows of as it appears (a relay; an instance pulls on command)."""

    def __init__(self, store: ParamStore, config: ParamsConfig, data_url: str, token: str | None = None,
                 follow: bool = False):
        assert config.holder_of is not None
        self.store, self.config, self.data_url = store, config, data_url
        self.holder_id = config.holder_id or f"holder-{uuid.uuid4().hex[:12]}"
        self.host = config.emulated_host or host_id()  # where the reference server places it (tiers, shm between peers)
        self.reference = ParamsClient(config.holder_of, timeout=600, token=token, puller_id=self.holder_id, zone=config.zone)
        self.token, self.follow = token, follow
        self.fetched: dict[str, int] = {}  # source -> chunks, over every pull
        self.failures: list[tuple[int, str, str]] = []
        self.unavailable: set[int] = set()  # versions the reference server said nobody can serve
        self._pulling = threading.Lock()  # one pull at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="params-holder", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.reference.close()

    def holdings(self) -> dict[int, list[int] | None]:
        with self.store.cond:
            held: dict[int, list[int] | None] = {v: None for v, s in self.store.versions.items() if s.retained}
            held.update({v: sorted(s.held or ()) for v, s in self.store.replicas.items()})
            return held

    def heartbeat(self) -> None:
        holdings = self.holdings()
        reply = self.reference.json(API.heartbeat, self.holder_id, url=self.data_url, host_id=self.host,
                                    zone=self.config.zone, spot=self.config.spot, holdings=holdings,
                                    transports=list(self.config.transports))
        for version in reply.get("missing", []):
            with self.store.cond:
                stored = self.store.versions.get(version)
                manifest = stored.manifest.to_json() if stored is not None else None
            if manifest is not None:
                self.reference.json(API.publish, self.holder_id, version, chunks=None, manifest=manifest)

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.heartbeat()
                if self.follow:
                    self._follow_once()
            except (ServiceError, OSError) as exc:  # the reference server restarting: the next beat tries again
                log.info("holder %s: heartbeat to %s failed (%s)", self.holder_id, self.config.holder_of, exc)
            except Exception:
                log.exception("holder %s: heartbeat failed", self.holder_id)
            self._stop.wait(self.config.holder_ttl_s / 4)

    def _follow_once(self) -> None:
        newest = self.reference.json(API.reference_manifest, "latest")["version"]
        if newest not in self.holdings():
            self.pull(newest)

    def pull(self, version: int | str) -> dict:
        """Pull ``version`` from its holders into this store (a no-op when held); returns where
        its chunks came from. Older versions beyond ``keep`` are unpublished first."""
        with self._pulling:
            manifest = Manifest.from_json(self.reference.json(API.reference_manifest, version))
            number = manifest.version
            if self.holdings().get(number, ()) is None:
                return {"version": number, "fetched": {}, "seconds": 0.0}
            self._make_room()
            started = time.monotonic()
            try:
                self.reference.json(API.publish, self.holder_id, number, chunks=[])  # joins the version's pipeline
            except ServiceError as exc:
                if exc.code is not ErrorCode.UNKNOWN_HOLDER:
                    raise
                self.heartbeat()
                self.reference.json(API.publish, self.holder_id, number, chunks=[])
            transport = PeerTransport(reference_sources(self.reference, self.holder_id, self.host, self.config.zone),
                                      lambda refresh: self.reference._data_url(refresh) or self.reference.url, 600,
                                      _bearer(self.token), report=True, peers=self.config.peer_transport)
            try:
                copy_into(self.store, manifest, transport)
            except ServiceError as exc:
                if exc.code is ErrorCode.VERSION_UNAVAILABLE:
                    self.unavailable.add(number)  # pulls of it here are refused at once with that code
                raise
            finally:
                transport.close()
                for source, n in transport.fetched.items():
                    self.fetched[source] = self.fetched.get(source, 0) + n
                self.failures.extend(transport.failures)
                self._release()
            self.reference.json(API.publish, self.holder_id, number, chunks=None)
            return {"version": number, "fetched": transport.fetched, "seconds": time.monotonic() - started,
                    "failures": len(transport.failures), "via": transport.fetched_via}

    def _release(self) -> None:
        try:
            self.reference.json(API.release_puller, self.holder_id)
        except (ServiceError, OSError):
            pass  # the assignment lapses on its own

    def _make_room(self) -> None:
        with self.store.cond:
            held = sorted(v for v, s in self.store.versions.items() if s.retained)
        for version in held[:max(0, len(held) - self.config.keep + 1)]:
            self.unpublish(version)

    def unpublish(self, version: int, wait_s: float = 600.0) -> None:
        """Unpublish ``version`` at the reference server (which returns once retention allows),
        then drop it here: reads in flight finish, new ones are refused, then its buffers go."""
        try:
            self.reference.json(API.unpublish, self.holder_id, version, wait_s=wait_s, timeout=wait_s + 60)
        except ServiceError as exc:
            if exc.code is not ErrorCode.UNKNOWN_HOLDER:  # not registered: nobody is sent here for it
                raise
        try:
            self.store.delete_version(version)
        except Exception as exc:  # already gone
            log.info("holder %s: version %d was not held any more (%s)", self.holder_id, version, exc)


__all__ = ["PS", "HolderAgent", "ReferenceServer", "advertised_url", "copy_into"]
