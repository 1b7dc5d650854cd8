"""Free TCP ports for a listener that binds later: a service's planned endpoint, a trainer's
rendezvous. One implementation for the services, the launchers and the trainer.

A port is drawn below the kernel's ephemeral range where that range is known: a port from inside
it (what binding port 0 hands out) can be taken by any process's outgoing connection before the
listener binds it, which then fails to start."""

from __future__ import annotations

import random
import socket

EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PLANNED_PORT = 10000


def free_port_between(host: str, low: int, high: int, taken: set[int] | frozenset = frozenset()) -> int | None:
    """A port free on ``host`` now, from [low, high], not in ``taken`` (None if there is none); tried
    from a random start so that planners on one host rarely race for the same port."""
    span = high - low + 1
    start = random.randrange(span) if span > 0 else 0
    for i in range(max(span, 0)):
        port = low + (start + i) % span
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, for a listener that binds it later, below the ephemeral range
    where that is known (else the kernel's pick)."""
    try:
        with open(EPHEMERAL_PORTS) as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the kernel's pick
        ephemeral_low = 0
    port = free_port_between(host, LOWEST_PLANNED_PORT, ephemeral_low - 1)
    if port is not None:
        return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
