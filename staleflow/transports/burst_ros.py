"""The ``ros`` burst sources of ``staleflow bench params --sources``: each instance is a holder
(a parameter server started with ``--holder-of`` the bench's PS, the same ``--egress-gbps`` link)
and pulls the version from the holders the PS names chunk by chunk, serving each chunk onward as
soon as it landed verified (pipeline replication; see docs/params.md). Every holder's bytes are
then read back over shm and their digest compared with the pushed version's.

* ``ros``: every holder is an endpoint on an emulated host of its own (``--emulated-host``), so
  holders read each other over http through their egress limits, as across real hosts.
* ``ros-shm``: the holders are on one host (this one) and read each other over shared memory
  (``--peer-transport auto``), the PS's copy still over its limited link: a node's instances, or
  the relays of one node.
* ``ros-nixl`` (where NIXL loads): as ``ros-shm``, the holders reading each other over NIXL
  (``--peer-transport nixl``; UCX between processes of one host).

Besides the burst seconds each outcome reports (``detail``): the chunks the PS itself sent, the
chunks fetched again after a failure, and the PS's own copies at the end of the burst and once its
retention settled (``ps_copies_after``: 0 once ``retain_replicas`` holders hold the version).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from staleflow.api.params import ParamsRoutes as API
from staleflow.transports.bench import aligned_array, start_params_server
from staleflow.transports.burst import (
    BURST,
    ELASTIC_JOIN,
    HOLDER_KILLED,
    PUSH_DURING_JOIN,
    BurstCase,
    BurstOutcome,
    BurstSetup,
    BurstSource,
    register_burst_source,
)
from staleflow.transports.checksums import checksum_algorithms, checksum_bytes
from staleflow.transports.client import ParamsClient
from staleflow.transports.nixl import nixl_available
from staleflow.transports.tables import table_bytes

SETTLE_S = 30.0
"""How long a burst's end waits for the PS to drop its copy (holders' heartbeats reach it every
quarter of their ttl)."""


@dataclass
class _Holder:
    name: str
    proc: object
    url: str


class _HolderRunner:
    """``max_instances`` holder processes of the bench's PS; a burst asks ``N`` of them to pull."""

    def __init__(self, setup: BurstSetup, one_host: bool = False, peers: str = "auto"):
        self.setup, self.one_host, self.peers = setup, one_host, peers
        self.total = table_bytes(setup.table)
        self.buffer = aligned_array(self.total, np.uint8, 1)
        self.algorithm = checksum_algorithms()[0]
        self.holders = [self._start(i) for i in range(setup.max_instances)]
        self.reference = ParamsClient(setup.ps_url, timeout=600)

    def _start(self, index: int) -> _Holder:
        name = f"holder-{index}"
        host = [] if self.one_host else ["--emulated-host", f"bench-host-{index}"]  # then no shm between them
        transports = ["http", "shm", "nixl"] if self.peers == "nixl" else ["http", "shm"]
        # one state directory per holder: a holder SIGKILLed and started again there removes the
        # shared memory the killed one left
        proc, url = start_params_server(
            self.setup.workdir / f"{name}-{'one-host' if self.one_host else 'own-host'}-{self.peers}", transports,
            self.setup.chunk_mb, persist=False, egress_gbps=self.setup.link_gbps,
            extra=["--holder-of", self.setup.ps_url, "--holder-id", name, "--no-holder-follows", "--holder-ttl", "4",
                   "--peer-transport", self.peers, *host])
        return _Holder(name, proc, url)

    def burst(self, version: int, case: BurstCase) -> BurstOutcome:
        pulling = self.holders[:case.instances + (case.join_after_s is not None)]
        held: dict[str, float] = {}
        replies: dict[str, dict] = {}
        started = time.monotonic()
        threads = [self._pull(h, version, held, replies) for h in pulling[:case.instances]]
        joined_at = killed = None
        if case.join_after_s is not None:
            time.sleep(case.join_after_s)  # the experiment's schedule: the joiner arrives mid-burst
            joined_at = time.monotonic()
            threads.append(self._pull(pulling[-1], version, held, replies))
        if case.kill_after_s is not None:
            time.sleep(case.kill_after_s)  # the experiment's schedule: a holder dies mid-burst
            killed = pulling[len(pulling) // 2]
            killed.proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        for thread in threads:
            thread.join()
        survivors = [h for h in pulling if h is not killed]
        digests = [self._digest(h, version) for h in survivors]
        detail: dict[str, int | str] = {"from_ps": sum(r.get("fetched", {}).get("ps", 0) for r in replies.values()),
                  "retried": sum(r.get("failures", 0) for r in replies.values()),
                  "via": ",".join(f"{t}:{n}" for t, n in sorted(_summed(r.get("via", {}) for r in replies.values()).items())),
                  "ps_copies_at_end": len(self.reference.json(API.references)["ps_copies"]),
                  "ps_copies_after": self._settled_copies(version, len(survivors))}
        if killed is not None:
            detail["killed"] = killed.name
            killed.proc.wait()  # type: ignore[attr-defined]  # its state directory is free again
            self.holders[self.holders.index(killed)] = self._start(self.holders.index(killed))
        return BurstOutcome(started, [held[h.name] for h in survivors], digests, joined_at, detail)

    def join(self, version: int, index: int) -> Callable[[], tuple[float, str]]:
        holder, held, replies = self.holders[index], {}, {}
        thread = self._pull(holder, version, held, replies)

        def wait() -> tuple[float, str]:
            thread.join()
            if holder.name not in held:
                raise RuntimeError(f"{holder.name} could not pull version {version} from the holders: "
                                   f"{replies.get(holder.name, {}).get('error')}")
            return held[holder.name], self._digest(holder, version)

        return wait

    def _pull(self, holder: _Holder, version: int, held: dict, replies: dict) -> threading.Thread:
        def pull() -> None:
            try:
                with ParamsClient(holder.url, timeout=600) as client:
                    replies[holder.name] = client.json(API.holder_pull, str(version))
                    held[holder.name] = time.monotonic()
            except Exception as exc:  # the holder killed mid-burst; else reported as the pull's failure
                replies[holder.name] = {"error": f"{exc.__class__.__name__}: {exc}"}

        thread = threading.Thread(target=pull, daemon=True)
        thread.start()
        return thread

    def _digest(self, holder: _Holder, version: int) -> str:
        if holder.name not in self._held_names():
            return "not held"
        with ParamsClient(holder.url, timeout=600) as client:
            client.pull(version, "shm", into=self.buffer)
        return checksum_bytes(self.algorithm, self.buffer)

    def _held_names(self) -> set[str]:
        return {h["holder_id"] for h in self.reference.json(API.references)["holders"]}

    def _settled_copies(self, version: int, holders: int) -> int:
        """The PS's copies once its retention acted on ``version`` (it drops its copy once
        ``replicas`` holders hold it; ``SETTLE_S`` at most)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            described = self.reference.json(API.references)
            copies = described["ps_copies"]
            if version not in copies or holders < described["replicas"] or time.monotonic() > deadline:
                return len(copies)
            time.sleep(0.1)  # polling pace: heartbeats come every quarter of the holders' ttl

    def close(self) -> None:
        self.reference.close()
        for holder in self.holders:
            holder.proc.terminate()  # type: ignore[attr-defined]
        for holder in self.holders:
            holder.proc.wait(60)  # type: ignore[attr-defined]


def _summed(counts: object) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:  # type: ignore[attr-defined]
        for key, n in count.items():
            total[key] = total.get(key, 0) + n
    return total


def _open_holders(setup: BurstSetup) -> contextlib.closing[_HolderRunner]:
    return contextlib.closing(_HolderRunner(setup))


def _open_holders_on_one_host(setup: BurstSetup) -> contextlib.closing[_HolderRunner]:
    return contextlib.closing(_HolderRunner(setup, one_host=True))


def _open_nixl_holders_on_one_host(setup: BurstSetup) -> contextlib.closing[_HolderRunner]:
    return contextlib.closing(_HolderRunner(setup, one_host=True, peers="nixl"))


register_burst_source(BurstSource(
    "ros", "peers: every instance is a holder, pulling chunk by chunk from the holders the PS names and serving "
           "what it holds (pipeline replication); each holder on an emulated host of its own (http between them)",
    _open_holders, cases=frozenset({BURST, ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN})))
register_burst_source(BurstSource(
    "ros-shm", "peers on one host: as ros, but the holders share this host and read each other over shared memory "
               "(the PS's copy still over its link)", _open_holders_on_one_host,
    cases=frozenset({BURST, ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN})))
if nixl_available()[0]:  # its holders enable NIXL, which a server without it refuses to start with
    register_burst_source(BurstSource(
        "ros-nixl", "peers on one host over NIXL: as ros-shm, the holders reading each other with NIXL READs (UCX)",
        _open_nixl_holders_on_one_host, cases=frozenset({BURST, ELASTIC_JOIN, HOLDER_KILLED, PUSH_DURING_JOIN})))
