"""What the trainer role needs from a trainer backend.

The role (``staleflow.servers.trainer``) does the I/O: it consumes a Ready buffer, fetches its batch,
hands it to the backend, pushes the weights the backend returns and frees batches once a checkpoint
covers them. A backend only trains, so the same role drives the simulated trainer and the FSDP one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any


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
    def weights(self, version: int) -> Mapping[str, Any]:
        """The state to push as ``version``, as tensors that the next ``train`` does not modify."""

    def checkpoint(self, version: int) -> bool:
        """Called after each step with the number of buffers trained so far. Returns True when a
        durable checkpoint now covers them (their batches are then no longer needed)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
