"""A parameter-server relay: a parameter server on a rollout machine that mirrors the job's
parameter server, so each version crosses the network once per machine and reaches the
instances there over shared memory (``transport: auto`` picks shm on the same host).

The relay is an ordinary parameter server (same API, same checksummed format) plus a mirror
loop: it asks the upstream server for its newest version and copies every version it does not
hold yet, oldest first, skipping versions the upstream no longer keeps. An instance told to
pull a version the relay is still copying waits for it (the pull's ``wait_s``). A relay that
restarts copies again; versions are immutable, so a copy is never wrong, only repeated.
"""

from __future__ import annotations

import logging
import threading

from staleflow.api.base import ServiceError
from staleflow.transports.client import ParamsClient

log = logging.getLogger(__name__)


class Mirror:
    """Copies new versions from ``upstream`` into ``local`` until ``stop`` is set."""

    def __init__(self, upstream: str, local: str, stop: threading.Event, poll_s: float = 0.2):
        self.upstream_url, self.local_url = upstream, local
        self.stop = stop
        self.poll_s = poll_s
        self.copied: list[int] = []

    def run(self) -> None:
        with ParamsClient(self.upstream_url, timeout=600) as upstream, ParamsClient(self.local_url, timeout=600) as local:
            while not self.stop.is_set():
                try:
                    self.sync(upstream, local)
                except Exception as exc:  # upstream restarting: the next round tries again
                    log.info("relay: mirroring %s failed (%s); retrying", self.upstream_url, exc)
                self.stop.wait(self.poll_s)  # poll pacing

    def sync(self, upstream: ParamsClient, local: ParamsClient) -> list[int]:
        """One round: copy what the upstream has and the relay lacks; the versions copied."""
        available = sorted(v.version for v in upstream.versions().versions)
        held = {v.version for v in local.versions().versions}
        newest_held = max(held, default=-1)
        copied = []
        for version in available:
            if version in held or version < newest_held:
                continue  # older than what it holds: no instance will be told to pull it from here
            try:
                tensors = upstream.pull(version)
            except ServiceError as exc:
                if exc.status in (404, 410):
                    continue  # evicted upstream meanwhile
                raise
            local.push(version, tensors)
            copied.append(version)
            self.copied.append(version)
        return copied
