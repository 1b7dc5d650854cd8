"""Weight transfer in the cluster simulation: where a Pull's bytes come from, and how long a Pull
takes when other instances pull the same version at the same time. Pure.

Every source is a sender with an egress rate that serves the bytes asked of it back to back (a
fluid queue): a pull of ``size`` bytes that starts at ``t`` on a sender whose queue drains at
``busy`` takes ``max(size / min(link, egress), max(busy, t) + size / egress - t)``, where ``link``
is the puller's own bandwidth (``SimParams.pull_bandwidth_bytes_per_s``); the sender's queue then
drains ``size / egress`` later. A pull that starts alone thus takes ``size / link`` as before, and
``N`` pulls that start at once on one sender finish by ``N x size / egress``: the burst of a
fan-out from one endpoint. The engine's fixed load time (``pull_latency_s``) comes on top.

* ``ps``: every pull is served by the parameter server, whose egress is
  ``ps_egress_bytes_per_s``. Unlimited (the default) is the paper's deployment (§A.1: PS workers
  on every rollout node, a Pull is a PCIe copy that waits for nobody), and gives exactly the
  durations the engine computes on its own (``SimParams.pull_seconds``).
* ``ros``: pipeline replication (TensorHub's reference-oriented storage). The first pull of a
  version comes from the PS; each later one is handed the source that finishes it first among
  the PS and every instance that holds the version or is pulling it (each instance's egress is
  its own link). An instance still pulling forwards each chunk as it lands, so a pull that
  follows it cannot end before it does plus one hop (``hop_seconds``: a chunk across the slower
  of the two links, plus ``hop_rtt_s``). A burst therefore forms a chain or a tree: about one
  pull's time plus a hop per level, bounded by the slowest link on the way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class WeightSource(StrEnum):
    PS = "ps"  # every instance pulls from the parameter server
    ROS = "ros"  # peers serve what they hold, pipelined


DEFAULT_CHUNK_BYTES = 64 << 20  # the parameter server's default chunk
DEFAULT_HOP_RTT_S = 0.0005


@dataclass(frozen=True)
class WeightTransfer:
    """How instances get a version's bytes (see the module docstring). ``ps_egress_bytes_per_s``:
    the parameter server's egress (``math.inf``: unlimited, the paper's PS workers on every node)."""

    source: WeightSource = WeightSource.PS
    ps_egress_bytes_per_s: float = math.inf
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    hop_rtt_s: float = DEFAULT_HOP_RTT_S

    def __post_init__(self) -> None:
        if not self.ps_egress_bytes_per_s > 0:
            raise ValueError("ps_egress_bytes_per_s must be > 0 (math.inf: unlimited)")
        if self.chunk_bytes < 1 or self.hop_rtt_s < 0:
            raise ValueError("chunk_bytes must be >= 1 and hop_rtt_s >= 0")

    @property
    def contends(self) -> bool:
        """Whether a pull can take longer than it would alone (else the engine's own time holds)."""
        return self.source is WeightSource.ROS or math.isfinite(self.ps_egress_bytes_per_s)

    def hop_seconds(self, link_a: float, link_b: float) -> float:
        return self.chunk_bytes / min(link_a, link_b) + self.hop_rtt_s


@dataclass
class _SimulatedSender:
    egress: float  # bytes/s
    busy: float = -math.inf  # when the bytes queued on it have left
    done: float = -math.inf  # when it holds the whole version (the PS: always)

    def finish(self, start: float, size: float, link: float, hop: float) -> float:
        """When a pull of ``size`` bytes starting at ``start`` would end if this sender served it."""
        alone = start + size / min(link, self.egress)
        queued = max(self.busy, start) + size / self.egress if math.isfinite(self.egress) else -math.inf
        return max(alone, queued, self.done + hop)

    def take(self, start: float, size: float) -> None:
        if math.isfinite(self.egress):
            self.busy = max(self.busy, start) + size / self.egress


class TransferSchedule:
    """The pulls of a simulated job, version by version: ``pull`` answers how long each one takes
    given the ones before it. An instance that pulls a version stops serving the ones it held
    (it reuses their buffers); versions older than the newest ``keep_versions`` are forgotten."""

    def __init__(self, transfer: WeightTransfer, keep_versions: int = 8):
        self.transfer = transfer
        self.keep_versions = keep_versions
        self._ps = _SimulatedSender(transfer.ps_egress_bytes_per_s)  # one egress, whatever the version
        self._holders: dict[int, dict[str, tuple[_SimulatedSender, float]]] = {}  # version -> instance -> (sender, link)

    def pull(self, instance: str, version: int, start: float, size: float, link: float) -> float:
        """Seconds the transfer of ``size`` bytes of ``version`` to ``instance`` (link ``link``
        bytes/s) takes, starting at ``start``; the pull is recorded, so later ones see it."""
        if size < 0 or not link > 0:
            raise ValueError("size must be >= 0 and link > 0")
        for held in self._holders.values():
            held.pop(instance, None)
        holders = self._holders.setdefault(version, {})
        for old in [v for v in self._holders if v <= version - self.keep_versions]:
            del self._holders[old]
        best, end = self._ps, self._ps.finish(start, size, link, 0.0)
        if self.transfer.source is WeightSource.ROS:
            for sender, other_link in holders.values():
                finish = sender.finish(start, size, link, self.transfer.hop_seconds(link, other_link))
                if finish < end:
                    best, end = sender, finish
        best.take(start, size)
        holders[instance] = (_SimulatedSender(link, done=end), link)
        return end - start
