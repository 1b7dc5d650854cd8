"""What the trainer role needs from a trainer backend.

The role (``staleflow.servers.trainer``) does the I/O: it consumes a Ready buffer, fetches its batch,
hands it to the backend, pushes the weights the backend returns and frees batches once a checkpoint
covers them. A backend only trains, so the same role drives the simulated trainer and the FSDP one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from staleflow.transports.client import ParamsClient, ShardPiece


@dataclass
class ShardedWeights:
    """One pusher's share of a version that several push at once (a sharded trainer's ranks):
    the whole tensor table and the pieces this one holds, snapshotted so training can go on."""

    part: int
    parts: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, full shape)
    pieces: list[ShardPiece] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(memoryview(p.data).nbytes if not hasattr(p.data, "nbytes") else int(p.data.nbytes) for p in self.pieces)

    def push(self, client: ParamsClient, version: int, wait_s: float = 600.0) -> dict:
        """Push this share; returns when the version is visible (every part in) or ``wait_s`` ran out."""
        return client.push_part(version, self.part, self.parts, self.tensors, self.pieces, wait_s=wait_s)


class TrainerBackend(abc.ABC):
    label: str = "trainer"

    def resume_version(self) -> int | None:
        """Buffers this backend has already trained, per its newest checkpoint; ``None`` when the
        backend keeps no state of its own (the role then trusts the parameter server's latest)."""
        return None

    @abc.abstractmethod
    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        """Train on buffer ``version``'s batch (the trajectory server's ``/v1/batches/{version}``
        document); returns the step's metrics, at least ``train_seconds``."""

    @abc.abstractmethod
    def weights(self, version: int) -> Mapping[str, Any] | ShardedWeights:
        """The state to push as ``version``, as tensors that the next ``train`` does not modify:
        the whole state dict, or this process's share of it when every shard holder pushes its own."""

    def checkpoint(self, version: int) -> bool:
        """Called after each step with the number of buffers trained so far. Returns True when a
        durable checkpoint now covers them (their batches are then no longer needed)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
