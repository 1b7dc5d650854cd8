"""Reference-oriented storage (ROS), pure: who holds which version, where a puller fetches each
chunk from, and which copies retention keeps (no I/O; the clock is an argument).

The parameter server is the *reference server*: besides its own copies it records holders (an
instance process, a relay) and the versions, or the chunks of a version, each of them holds.
A holder's record is soft state: it lapses ``holder_ttl_s`` after the holder's last heartbeat,
and a restarted reference server rebuilds every record from the next heartbeats.

* **Sources.** For each chunk a puller asks for, the candidates are, in order: holders on the
  puller's host, then in its zone, then any other holder, each tier least-loaded first, and last
  the PS's own copy. A holder still pulling the version (pipeline replication) is a candidate for
  a chunk it does not have yet only for pullers that joined after it (so the waits form a DAG,
  never a cycle); it serves the chunk once it lands. Load is the number of pullers a source is
  assigned to; among equals the one that joined last. A burst of pullers then forms a chain
  (each one reading from the one that joined just before it, whatever order their asks come in),
  not an N-way fan-out from the PS. Nobody to serve a chunk: ``version_unavailable``.
* **Retention.** The newest ``retain`` versions must stay available. The PS drops its host copy
  of a retained version once ``replicas`` non-spot holders hold it whole; it takes a copy back
  (from a holder) as soon as fewer than ``replicas`` fresh non-spot holders hold it, which is
  before the last one unpublishes (an unpublish waits for it) or is declared failed (a holder
  silent for half its ttl no longer counts, so the copy starts while it is probably still up).
  Spot holders serve but never count.
* **Unpublish ordering.** A holder that unpublishes is withdrawn as a source at once; it is
  forgotten (and may reuse its buffers once its in-flight reads end) only once its leaving keeps
  every retained version it held available.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from staleflow.errors import ErrorCode, StaleFlowError

PS = "ps"
"""The source name of the reference server's own copy."""


class ReferenceError(StaleFlowError):
    """A request the reference rules refuse (``version_unavailable``, ``unknown_holder``, ...)."""


@dataclass
class HolderRecord:
    """A holder as its heartbeats describe it. ``holdings``: version -> the chunk indices it holds
    (``None``: all of them); ``joined``: version -> the order it started pulling that version in
    (pipeline sources must have joined earlier)."""

    holder_id: str
    url: str  # where its chunks are served (the data plane of its parameter store)
    host_id: str
    zone: str = ""
    spot: bool = False
    last_seen: float = 0.0
    holdings: dict[int, frozenset[int] | None] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)
    withdrawing: set[int] = field(default_factory=set)  # unpublished, waiting for retention to be safe
    suspect: bool = False  # a puller reported a failed transfer from it: no source, not counted, until its next heartbeat
    transports: tuple[str, ...] = ("http",)  # what it serves peers over

    def holds_whole(self, version: int) -> bool:
        return version in self.holdings and self.holdings[version] is None

    def has_chunk(self, version: int, chunk: int) -> bool:
        held = self.holdings.get(version, frozenset())
        return held is None or chunk in held

    def summary(self) -> dict:
        return {"holder_id": self.holder_id, "url": self.url, "host_id": self.host_id, "zone": self.zone,
                "spot": self.spot, "transports": list(self.transports),
                "versions": {str(v): (None if c is None else len(c)) for v, c in sorted(self.holdings.items())},
                "withdrawing": sorted(self.withdrawing)}


@dataclass(frozen=True)
class Source:
    """Where to fetch one chunk: a holder (``holder_id``) or the PS's own copy (``PS``)."""

    holder_id: str
    url: str | None  # None for the PS: the puller reaches it at the URL it already has
    has_chunk: bool  # False: a holder still pulling; it serves the chunk once it lands
    tier: str  # "host", "zone", "other" or "ps"
    transports: tuple[str, ...] = ("http",)  # what the source serves peers over


@dataclass
class RetentionPlan:
    """What the PS should do about its own copies now."""

    drop: list[int] = field(default_factory=list)  # retained versions it may drop (enough holders)
    copy_back: dict[int, list[str]] = field(default_factory=dict)  # version -> holders to copy it from
    forget: list[int] = field(default_factory=list)  # versions past retention nobody needs kept


def retained_versions(versions: Iterable[int], retain: int) -> list[int]:
    """The newest ``retain`` versions, oldest first."""
    return sorted(set(versions))[-retain:] if retain > 0 else []


class ReferenceTable:
    """The reference server's soft state and rules. Not thread-safe: the caller locks."""

    def __init__(self, retain: int, replicas: int, holder_ttl_s: float):
        if retain < 1 or replicas < 1 or holder_ttl_s <= 0:
            raise ValueError("retain and replicas must be >= 1, holder_ttl_s > 0")
        self.retain, self.replicas, self.holder_ttl_s = retain, replicas, holder_ttl_s
        self.holders: dict[str, HolderRecord] = {}
        self.chunk_counts: dict[int, int] = {}  # versions the reference knows -> their chunk count
        self.ps_copies: set[int] = set()  # versions the PS holds in its own memory
        self.assigned: dict[str, tuple[str, float]] = {}  # puller -> (source, assigned at)
        self._order = itertools.count()

    # -- what exists

    def known(self, version: int, chunks: int, ps_copy: bool) -> None:
        """The PS committed ``version`` (``ps_copy``: and holds it), or recovered it."""
        self.chunk_counts[version] = chunks
        if ps_copy:
            self.ps_copies.add(version)

    def ps_copy(self, version: int, held: bool) -> None:
        (self.ps_copies.add if held else self.ps_copies.discard)(version)

    def retained(self) -> list[int]:
        return retained_versions(self.chunk_counts, self.retain)

    # -- holders

    def heartbeat(self, holder_id: str, url: str, host_id: str, zone: str, spot: bool,
                  holdings: Mapping[int, Iterable[int] | None], now: float,
                  transports: Iterable[str] = ("http",)) -> HolderRecord:
        """A holder says it is alive, what it holds and what it serves over; its record is
        replaced (soft state)."""
        record = self.holders.get(holder_id)
        if record is None:
            record = self.holders[holder_id] = HolderRecord(holder_id, url, host_id)
        record.url, record.host_id, record.zone, record.spot, record.last_seen = url, host_id, zone, spot, now
        record.transports = tuple(transports)
        record.suspect = False  # it is alive
        previous = record.holdings
        # an unpublish in progress keeps what it withdraws: the PS may still copy it back from there
        record.holdings = {v: previous[v] for v in record.withdrawing if v in previous}
        for version, chunks in holdings.items():
            if version not in record.withdrawing:
                self._set_holding(record, version, chunks)
        for version in set(previous) - set(record.holdings):
            record.joined.pop(version, None)
        return record

    def publish(self, holder_id: str, version: int, chunks: Iterable[int] | None, now: float) -> HolderRecord:
        """``holder_id`` holds ``chunks`` of ``version`` (``None``: all of it). A first publish of
        a version, even of no chunk, says the holder is pulling it (its place in the pipeline)."""
        record = self._record(holder_id)
        record.last_seen = now
        record.withdrawing.discard(version)
        self._set_holding(record, version, chunks)
        return record

    def _set_holding(self, record: HolderRecord, version: int, chunks: Iterable[int] | None) -> None:
        count = self.chunk_counts.get(version)
        held = None if chunks is None else frozenset(chunks)
        if held is not None and count is not None and len(held) >= count and held == frozenset(range(count)):
            held = None
        record.holdings[version] = held
        record.joined.setdefault(version, next(self._order))

    def _record(self, holder_id: str) -> HolderRecord:
        record = self.holders.get(holder_id)
        if record is None:
            raise ReferenceError(ErrorCode.UNKNOWN_HOLDER, f"holder {holder_id!r} is not registered (the reference server "
                                                           "restarted, or its heartbeats lapsed): send a heartbeat first")
        return record

    def fresh(self, record: HolderRecord, now: float) -> bool:
        return now - record.last_seen <= self.holder_ttl_s

    def trusted(self, record: HolderRecord, now: float) -> bool:
        """Counts for retention: non-spot, not suspect and heard from within half its ttl."""
        return not record.spot and not record.suspect and now - record.last_seen <= self.holder_ttl_s / 2

    def report_failed(self, holder_ids: Iterable[str]) -> None:
        """Pullers saw transfers from these holders fail: no puller is sent to them, and they do not
        count for retention, until their next heartbeat says they are alive."""
        for holder_id in holder_ids:
            record = self.holders.get(holder_id)
            if record is not None:
                record.suspect = True

    def expire(self, now: float) -> list[str]:
        """Forget holders whose heartbeats lapsed (declared failed); their ids."""
        gone = [h for h, record in self.holders.items() if not self.fresh(record, now)]
        for holder_id in gone:
            del self.holders[holder_id]
        for puller, (source, at) in list(self.assigned.items()):
            if source in gone or puller in gone or now - at > self.holder_ttl_s:
                del self.assigned[puller]
        return gone

    # -- sources

    def load(self, source: str) -> int:
        return sum(1 for assigned, _ in self.assigned.values() if assigned == source)

    def sources(self, version: int, chunk: int, puller: str, host_id: str, zone: str, now: float,
                exclude: Sequence[str] = (), count: int = 1) -> list[Source]:
        """Where ``puller`` may fetch ``chunk`` of ``version`` (and the ``count - 1`` chunks after
        it), best first; the first one is assigned to it (its load), replacing its previous
        assignment. Raises ``version_unavailable`` when no holder and no copy of the PS can serve it."""
        total = self.chunk_counts.get(version)
        if total is None:
            raise ReferenceError(ErrorCode.VERSION_UNAVAILABLE, f"version {version} is not known here (retained: {self.retained()})")
        if not 0 <= chunk < total:
            raise ReferenceError(ErrorCode.UNKNOWN_CHUNK, f"version {version} has chunks 0..{total - 1}, not {chunk}")
        own = self.holders.get(puller)
        order = own.joined.get(version) if own is not None else None
        self.assigned.pop(puller, None)
        ranked = []
        for record in self.holders.values():
            if record.holder_id == puller or record.holder_id in exclude or version in record.withdrawing:
                continue
            if version not in record.holdings or not self.fresh(record, now) or record.suspect:
                continue
            has = all(record.has_chunk(version, c) for c in range(chunk, min(chunk + count, total)))
            if not has and (order is None or record.joined.get(version, order) >= order):
                continue  # a pipeline source must have joined before the puller: no cycles
            tier = "host" if record.host_id == host_id else "zone" if zone and record.zone == zone else "other"
            # among equals the latest joiner: each puller's closest predecessor, which no one else
            # picks first, whatever order the asks arrive in (a chain, not a tree of shared links)
            key = ({"host": 0, "zone": 1, "other": 2}[tier], self.load(record.holder_id), not has,
                   -record.joined.get(version, 0))
            ranked.append((key, Source(record.holder_id, record.url, has, tier, record.transports)))
        ranked.sort(key=lambda pair: pair[0])
        found = [source for _, source in ranked]
        if version in self.ps_copies and PS not in exclude:
            found.append(Source(PS, None, True, "ps"))
        if not found:
            raise ReferenceError(ErrorCode.VERSION_UNAVAILABLE,
                                 f"nobody can serve chunk {chunk} of version {version}: no holder holds it"
                                 f"{' (excluded: ' + ', '.join(exclude) + ')' if exclude else ''} and the parameter "
                                 "server dropped its copy; pull a version that exists")
        self.assigned[puller] = (found[0].holder_id, now)
        return found

    def release(self, puller: str) -> None:
        """``puller`` finished (or gave up): its source's load drops."""
        self.assigned.pop(puller, None)

    # -- retention and unpublish

    def counted_holders(self, version: int, now: float, without: str | None = None) -> list[HolderRecord]:
        """Fresh, non-spot holders of the whole ``version`` that are not withdrawing it."""
        return [r for r in self.holders.values()
                if r.holder_id != without and r.holds_whole(version) and version not in r.withdrawing and self.trusted(r, now)]

    def withdraw(self, holder_id: str, version: int) -> None:
        """First step of an unpublish: no puller is sent to ``holder_id`` for ``version`` any more
        (the PS may still copy the version back from it)."""
        record = self._record(holder_id)
        if version in record.holdings:
            record.withdrawing.add(version)

    def unpublish_safe(self, holder_id: str, version: int, now: float) -> bool:
        """Whether ``holder_id`` may drop ``version`` now: the version is not retained, or the PS
        holds a copy, or another fresh non-spot holder holds it whole."""
        if version not in self.retained() or version in self.ps_copies:
            return True
        return bool(self.counted_holders(version, now, without=holder_id))

    def finish_unpublish(self, holder_id: str, version: int) -> None:
        record = self.holders.get(holder_id)
        if record is not None:
            record.holdings.pop(version, None)
            record.joined.pop(version, None)
            record.withdrawing.discard(version)

    def plan(self, now: float) -> RetentionPlan:
        """The PS's copies to drop and to take back, and versions past retention."""
        plan = RetentionPlan()
        retained = set(self.retained())
        for version in sorted(retained):
            counted = self.counted_holders(version, now)
            if version in self.ps_copies:
                if len(counted) >= self.replicas:
                    plan.drop.append(version)
            elif len(counted) < self.replicas:
                # copy from any holder of the whole version, withdrawing ones included (they wait for it)
                donors = [r for r in self.holders.values() if r.holds_whole(version) and self.fresh(r, now) and not r.suspect]
                donors.sort(key=lambda r: (version in r.withdrawing, r.spot, -r.last_seen))
                if donors:
                    plan.copy_back[version] = [r.holder_id for r in donors]
        plan.forget = sorted(v for v in self.chunk_counts if v not in retained)
        return plan

    def forget(self, version: int) -> None:
        self.chunk_counts.pop(version, None)
        self.ps_copies.discard(version)

    def available(self, version: int, now: float) -> bool:
        """Someone can serve every chunk of ``version``: the PS or a fresh holder of it whole."""
        if version in self.ps_copies:
            return True
        return any(r.holds_whole(version) and self.fresh(r, now) and version not in r.withdrawing and not r.suspect
                   for r in self.holders.values())

    def describe(self, now: float) -> dict:
        return {"retain": self.retain, "replicas": self.replicas, "holder_ttl_s": self.holder_ttl_s,
                "retained": self.retained(), "ps_copies": sorted(self.ps_copies),
                "available": [v for v in self.retained() if self.available(v, now)],
                "holders": [r.summary() for r in sorted(self.holders.values(), key=lambda r: r.holder_id)],
                "loads": {s: self.load(s) for s in sorted({s for s, _ in self.assigned.values()})}}
