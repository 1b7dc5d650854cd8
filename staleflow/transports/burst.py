"""Bursts of instances pulling one version at once, per weight source (``staleflow bench params
--sources ps[,ros] --link-gbps X``).

The bench runs a parameter server in its own process with an egress limit (``--egress-gbps``: a
token bucket over every chunk body it sends, ``staleflow.transports.egress``), so one machine
emulates hosts joined by links of ``X`` Gbit/s and a fan-out from one endpoint is bounded by that
endpoint's link, as between real hosts. For each source and each number of instances ``N`` it
pushes a new version (not timed), asks ``N`` instance processes to pull it at once and records
**burst seconds**: from the ask until every instance holds the version, each chunk verified
against the manifest's checksum as it lands. The bench then checks each instance's whole-version
digest against the pushed bytes' (a cell whose digests differ is an error, not a number). Besides
the bursts of ``N``: an **elastic join** (one more instance asks for the version halfway through a
single pull's time into a burst of the largest ``N``), a **holder killed mid-burst**, where the
source has holders it can lose, and the **trainer's push during an elastic join**: once the
largest ``N`` hold version ``v``, the trainer pushes ``v+1`` over http alone and, in turn, while
one more instance pulls ``v`` (from the PS with ``ps``, from the holders with ``ros``); push
seconds with and without the join and their ratio (``pushes`` in the results: does a join stall
the trainer?).

Sources are a registry (``BURST_SOURCES``, ``register_burst_source``): a ``BurstSource`` names
what it measures, which cases it runs (``CASES``) and how to open a runner on a ``BurstSetup``
(the PS's URL, the table, the link, the number of instance processes to hold). ``ps`` is today's
fan-out: every instance pulls from the parameter server. A source defined in another module
registers itself there when that module is imported (the CLI imports ``burst_ros``, the ``ros``
source); asking for one that is not registered is a clear error naming those that are.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import numpy as np

from staleflow.transports.bench import Workers, aligned_array, commands, start_params_server, tensor_table
from staleflow.transports.checksums import checksum_algorithms, checksum_bytes
from staleflow.transports.egress import bytes_per_s_of_gbps
from staleflow.transports.tables import table_bytes

BURST, ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN = "burst", "elastic_join", "holder_killed", "push_during_join"
CASES = (BURST, ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN)
JOIN_AT = 0.5  # the joiner asks this fraction of one instance's pull time into the burst
DEFAULT_BURST_BYTES = 128 * 10**6  # about 1 s per pull at 1 Gbit/s


@dataclass(frozen=True)
class BurstSetup:
    """What a source's runner is opened on: the parameter server (already holding nothing, its
    egress limited to ``link_gbps``), the table every version has, and how many instance
    processes the runs need at most (the joiner included)."""

    ps_url: str
    table: dict[str, tuple[str, tuple[int, ...]]]
    link_gbps: float | None
    chunk_mb: int
    max_instances: int
    workdir: Path


@dataclass(frozen=True)
class BurstCase:
    """One run: ``instances`` pull the version at once; ``join_after_s``: one more asks this long
    after them; ``kill_after_s``: a holder is SIGKILLed this long after the start."""

    kind: str
    instances: int
    join_after_s: float | None = None
    kill_after_s: float | None = None


@dataclass
class BurstOutcome:
    """What a runner saw, on this host's monotonic clock: when the pulls were asked for, when each
    instance held the version (the joiner last), each instance's digest of the bytes it holds
    (``checksum_bytes`` of the data section), when the joiner asked, and what else the source
    reports (``detail``: e.g. chunks retried after a holder died)."""

    started: float
    held: list[float]
    digests: list[str]
    joined_at: float | None = None
    detail: dict = field(default_factory=dict)


class BurstRunner(Protocol):
    def burst(self, version: int, case: BurstCase) -> BurstOutcome: ...

    def join(self, version: int, index: int) -> Callable[[], tuple[float, str]]:
        """Instance ``index`` starts pulling ``version`` now; the call returned waits until it
        holds it and returns when (this host's monotonic clock) and the digest of what it holds."""
        ...


@dataclass(frozen=True)
class BurstSource:
    name: str
    summary: str
    open: Callable[[BurstSetup], AbstractContextManager[BurstRunner]]
    cases: frozenset[str] = frozenset({BURST, ELASTIC_JOIN, PUSH_DURING_JOIN})
    unsupported: dict[str, str] = field(default_factory=dict)  # case -> why this source cannot run it


BURST_SOURCES: dict[str, BurstSource] = {}


def register_burst_source(source: BurstSource) -> None:
    """Adds ``source`` (by its name) to ``BURST_SOURCES``; the name must be new."""
    if source.name in BURST_SOURCES:
        raise ValueError(f"burst source {source.name!r} is registered already")
    if not source.cases <= set(CASES) or BURST not in source.cases:
        raise ValueError(f"burst source {source.name!r}: cases must include {BURST!r} and come from {CASES}")
    BURST_SOURCES[source.name] = source


def unknown_sources(names: Sequence[str]) -> list[str]:
    """What is wrong with asking for ``names``, one sentence per name that cannot run here."""
    problems = []
    for name in names:
        if name not in BURST_SOURCES:
            problems.append(f"unknown source {name!r} (sources: {', '.join(sorted(BURST_SOURCES))})")
    return problems


# ---------------------------------------------------------------------- the ps source


def _burst_instance_main(conn: Connection, url: str, total_bytes: int) -> None:
    """An instance: holds a buffer of the version's size; on ("pull", version) pulls the version
    over http into it (each chunk verified against its checksum as it lands) and answers when it
    held it and the digest of what it holds."""
    from staleflow.transports.client import ParamsClient

    buffer = aligned_array(total_bytes, np.uint8, 1)
    algorithm = checksum_algorithms()[0]
    with ParamsClient(url, timeout=600) as client:
        conn.send({"ready": True})
        for _, version in commands(conn):
            asked = time.monotonic()
            client.pull(version, "http", into=buffer, verify="auto", wait_s=60)
            held = time.monotonic()
            conn.send({"asked": asked, "held": held, "digest": checksum_bytes(algorithm, buffer)})


class _FanOutRunner:
    """Every instance pulls from the parameter server: ``N`` pulls share its egress."""

    def __init__(self, setup: BurstSetup):
        total = table_bytes(setup.table)
        self.workers = Workers(_burst_instance_main, lambda _: (setup.ps_url, total), setup.max_instances)

    def burst(self, version: int, case: BurstCase) -> BurstOutcome:
        conns = self.workers.conns
        started = time.monotonic()
        for conn in conns[:case.instances]:
            conn.send(("pull", version))
        joined_at = None
        if case.join_after_s is not None:
            time.sleep(case.join_after_s)  # the experiment's schedule: the joiner arrives mid-burst
            joined_at = time.monotonic()
            conns[case.instances].send(("pull", version))
        answers = self.workers.gather(case.instances + (case.join_after_s is not None))
        return BurstOutcome(started, [a["held"] for a in answers], [a["digest"] for a in answers], joined_at)

    def join(self, version: int, index: int) -> Callable[[], tuple[float, str]]:
        self.workers.conns[index].send(("pull", version))

        def held() -> tuple[float, str]:
            answer = self.workers.answer(index)
            return answer["held"], answer["digest"]

        return held

    def close(self) -> None:
        self.workers.close()


def _open_fan_out(setup: BurstSetup) -> contextlib.closing[_FanOutRunner]:
    return contextlib.closing(_FanOutRunner(setup))


register_burst_source(BurstSource(
    "ps", "today's fan-out: every instance pulls from the parameter server, sharing its egress", _open_fan_out,
    unsupported={HOLDER_KILLED: "the parameter server is the only holder: killing it ends every pull"}))


# ---------------------------------------------------------------------- the bench


class _Publisher:
    """The trainer's side: pushes version ``v`` of the table (bytes that depend on ``v``) and
    knows its digest."""

    def __init__(self, url: str, table: dict):
        from staleflow.transports.client import ParamsClient

        self.table = table
        self.total = table_bytes(table)
        self.flat = aligned_array(self.total, np.uint8, 0)
        self.client = ParamsClient(url, timeout=600)
        self.algorithm = checksum_algorithms()[0]
        self.push_seconds = 0.0

    def publish(self, version: int, transport: str = "auto") -> str:
        """Push ``version`` (its bytes made first, untimed; ``push_seconds``: the push itself) and
        return its digest."""
        words = self.flat[:self.total - self.total % 4].view(np.uint32)
        np.multiply(np.arange(words.size, dtype=np.uint32), np.uint32(2 * version + 1), out=words)
        tensors, at = {}, 0
        for name, (_, shape) in self.table.items():
            n = int(np.prod(shape)) * 4
            tensors[name] = self.flat[at:at + n].view(np.uint32).reshape(shape)
            at += n
        started = time.monotonic()
        self.client.push(version, tensors, transport=transport)
        self.push_seconds = time.monotonic() - started
        return checksum_bytes(self.algorithm, self.flat)

    def withdraw(self, version: int) -> None:
        self.client.delete_version(version)

    def close(self) -> None:
        self.client.close()


def _cell(source: str, case: BurstCase, outcomes: list[BurstOutcome], total_bytes: int,
          link_bytes_per_s: float | None) -> dict:
    bursts = [max(o.held) - o.started for o in outcomes]
    cell = {"source": source, "kind": case.kind, "instances": case.instances, "runs": len(outcomes),
            "burst_seconds": statistics.median(bursts), "burst_seconds_all": bursts,
            "pull_seconds_max": statistics.median([max(o.held[:case.instances]) - o.started for o in outcomes]),
            "pull_seconds_mean": statistics.median([statistics.fmean(o.held[:case.instances]) - o.started
                                                    for o in outcomes]),
            "verified": True}
    moved = total_bytes * (case.instances + (case.join_after_s is not None))
    cell["delivered_gb_per_s"] = moved / cell["burst_seconds"] / 1e9
    if link_bytes_per_s:
        cell["links_worth"] = moved / cell["burst_seconds"] / link_bytes_per_s  # 1.0: one link's worth delivered
        cell["vs_wire_time"] = cell["burst_seconds"] / (total_bytes / link_bytes_per_s)  # against one version on one link
    if case.join_after_s is not None:
        cell["join_after_s"] = case.join_after_s
        cell["join_seconds"] = statistics.median([o.held[-1] - o.joined_at for o in outcomes if o.joined_at is not None])
    details = [o.detail for o in outcomes if o.detail]
    if details:
        cell["detail"] = details
    return cell


def _run_case(runner: BurstRunner, publisher: _Publisher, case: BurstCase, repeats: int, next_version: Callable[[], int],
              advance: Callable[[], None]) -> list[BurstOutcome]:
    outcomes = []
    for _ in range(repeats):
        version = next_version()
        expected = publisher.publish(version)
        outcome = runner.burst(version, case)
        publisher.withdraw(version)
        _check_digests(outcome, expected, f"{case.kind} of {case.instances}, version {version}")
        outcomes.append(outcome)
        advance()
    return outcomes


def _source_cells(source: BurstSource, setup: BurstSetup, publisher: _Publisher, instance_counts: Sequence[int],
                  repeats: int, next_version: Callable[[], int], advance: Callable[[int], None],
                  cases: Sequence[str] = CASES) -> tuple[list, list, list]:
    """Every cell of one source: bursts of each count, then the elastic join, the holder kill and
    the push during a join (of those ``cases`` asks for); the cells, the push rows, the skipped."""
    total = table_bytes(setup.table)
    link = bytes_per_s_of_gbps(setup.link_gbps) if setup.link_gbps else None
    cells, pushes, skipped = [], [], []
    biggest = max(instance_counts)
    with source.open(setup) as runner:
        for n in instance_counts if BURST in cases else ():
            case = BurstCase(BURST, n)
            cells.append(_cell(source.name, case, _run_case(runner, publisher, case, repeats, next_version,
                                                            lambda: advance(1)), total, link))
        single = next((c for c in cells if c["instances"] == 1), None)
        for kind in (k for k in (ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN) if k in cases):
            if kind not in source.cases:
                why = source.unsupported.get(kind, "this source does not run it")
                skipped.append({"source": source.name, "kind": kind, "instances": biggest, "why": why})
                advance(repeats)
                continue
            if kind == PUSH_DURING_JOIN:
                pushes.append(_push_row(source.name, runner, publisher, biggest, repeats, next_version, advance))
                continue
            single = single or _single(runner, publisher, next_version, total, link)
            after = JOIN_AT * single["burst_seconds"]
            case = BurstCase(kind, biggest, join_after_s=after if kind == ELASTIC_JOIN else None,
                             kill_after_s=after if kind == HOLDER_KILLED else None)
            cells.append(_cell(source.name, case, _run_case(runner, publisher, case, repeats, next_version,
                                                            lambda: advance(1)), total, link))
    for cell in cells:
        cell["vs_single"] = cell["burst_seconds"] / single["burst_seconds"] if single else None
    return cells, pushes, skipped


def _push_row(source: str, runner: BurstRunner, publisher: _Publisher, instances: int, repeats: int,
              next_version: Callable[[], int], advance: Callable[[int], None]) -> dict:
    """The trainer's push of a new version alone and during an elastic join, ``repeats`` times:
    ``instances`` hold version ``v`` (a burst, untimed); then ``v+1`` is pushed over http alone and
    ``v+2`` while one more instance pulls ``v`` (in turn which comes first)."""
    alone, joined, joins, overlaps = [], [], [], []
    for repeat in range(repeats):
        version = next_version()
        expected = publisher.publish(version)
        held = runner.burst(version, BurstCase(BURST, instances))
        _check_digests(held, expected, f"the burst of {instances} before a push")
        for with_join in (repeat % 2 == 1, repeat % 2 == 0):
            pushed = next_version()
            wait = runner.join(version, instances) if with_join else None
            join_started = time.monotonic()
            publisher.publish(pushed, transport="http")
            push_ended = time.monotonic()
            publisher.withdraw(pushed)
            if wait is None:
                alone.append(publisher.push_seconds)
                continue
            joined.append(publisher.push_seconds)
            held_at, digest = wait()
            if digest != expected:
                raise RuntimeError(f"the joiner holds bytes other than version {version}'s (digest {expected})")
            joins.append(held_at - join_started)
            push_started = push_ended - publisher.push_seconds
            overlaps.append(max(0.0, min(push_ended, held_at) - push_started) / publisher.push_seconds)
        publisher.withdraw(version)
        advance(1)
    with_join, without = statistics.median(joined), statistics.median(alone)
    return {"source": source, "kind": PUSH_DURING_JOIN, "instances": instances, "runs": repeats,
            "push_transport": "http", "push_seconds": without, "push_seconds_all": alone,
            "push_seconds_with_join": with_join, "push_seconds_with_join_all": joined,
            "push_ratio": with_join / without, "join_seconds": statistics.median(joins),
            "join_overlap": statistics.median(overlaps), "verified": True}


def _check_digests(outcome: BurstOutcome, expected: str, what: str) -> None:
    wrong = [i for i, digest in enumerate(outcome.digests) if digest != expected]
    if wrong or len(outcome.digests) != len(outcome.held):
        raise RuntimeError(f"{what}: instance(s) {wrong} hold bytes other than the version's (digest {expected})")


def _single(runner: BurstRunner, publisher: _Publisher, next_version: Callable[[], int], total: int,
            link: float | None) -> dict:
    """One instance's pull, the reference of the ratios, when the counts leave it out."""
    case = BurstCase(BURST, 1)
    return _cell("reference", case, _run_case(runner, publisher, case, 1, next_version, lambda: None), total, link)


def run_burst_bench(sources: Sequence[str], instance_counts: Sequence[int], total_bytes: int = DEFAULT_BURST_BYTES,
                    link_gbps: float | None = None, repeats: int = 3, chunk_mb: int = 64,
                    planned: Callable[[int], None] = lambda _: None, advance: Callable[[int], None] = lambda _: None,
                    cases: Sequence[str] = CASES) -> dict:
    """Each source's bursts side by side against one parameter server (see the module docstring),
    of the ``cases`` asked for. Progress: ``planned(steps)`` once, then ``advance(steps)``."""
    problems = unknown_sources(sources) + [f"unknown case {c!r} (cases: {', '.join(CASES)})" for c in cases
                                           if c not in CASES]
    if problems:
        raise ValueError("; ".join(problems))
    table = tensor_table(total_bytes)
    total = table_bytes(table)
    results: dict = {"mode": "burst", "sources": list(sources), "instances": list(instance_counts), "bytes": total,
                     "tensors": len(table), "chunk_mb": chunk_mb, "link_gbps": link_gbps, "repeats": repeats,
                     "transport": "http", "cpus": os.cpu_count(), "load_average_before": os.getloadavg()[0],
                     "cases": list(cases), "cells": [], "pushes": [], "skipped": []}
    steps = (len(instance_counts) if BURST in cases else 0) + sum(c in cases for c in CASES if c != BURST)
    planned(len(sources) * repeats * steps)
    counter = iter(range(1, 1 << 30))
    with tempfile.TemporaryDirectory(prefix="staleflow-bench-burst-") as tmp:
        # keep 2 (a job's retain with eta 1): the version being joined stays retained (available from
        # its holders) while the trainer pushes the next one
        proc, url = start_params_server(Path(tmp) / "ps", ["http", "shm"], chunk_mb, persist=False, egress_gbps=link_gbps,
                                        keep=2)
        publisher = None
        try:
            publisher = _Publisher(url, table)
            results["ps_egress_gbps"] = publisher.client.health().egress_gbps  # what the PS says it applies
            setup = BurstSetup(url, table, link_gbps, chunk_mb, max(instance_counts) + 1, Path(tmp))
            for name in sources:
                cells, pushes, skipped = _source_cells(BURST_SOURCES[name], setup, publisher, instance_counts, repeats,
                                                       lambda: next(counter), advance, cases)
                results["cells"] += cells
                results["pushes"] += pushes
                results["skipped"] += skipped
        finally:
            if publisher is not None:
                publisher.close()
            proc.terminate()
            proc.wait(60)
    results["load_average_after"] = os.getloadavg()[0]
    return results


def plot_bursts(results: dict, path: Path) -> None:
    """Burst seconds against instances, one line per source, with the ideal fan-out (N single pulls)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for source in results["sources"]:
        cells = sorted((c for c in results["cells"] if c["source"] == source and c["kind"] == BURST),
                       key=lambda c: c["instances"])
        axes.plot([c["instances"] for c in cells], [c["burst_seconds"] for c in cells], marker="o", label=source)
        single = next((c["burst_seconds"] for c in cells if c["instances"] == 1), None)
        if single is not None and source == results["sources"][0]:
            counts = [c["instances"] for c in cells]
            axes.plot(counts, [single * n for n in counts], linestyle=":", color="grey", label="N x one pull")
    link = f"{results['link_gbps']:g} Gbit/s per endpoint" if results.get("link_gbps") else "no egress limit"
    axes.set_title(f"{results['bytes'] / 1e6:.0f} MB version, {link}")
    axes.set_xlabel("instances pulling at once")
    axes.set_ylabel("seconds until every instance holds it")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)

