"""A trainer that trains nothing: a step-time model, for simulated clusters and what-if studies."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from staleflow.training.base import TrainerBackend


class SimulatedBackend(TrainerBackend):
    """Waits ``seconds_per_step + seconds_per_token x tokens`` simulated seconds (divided by the
    sim clock's ``speed``) per batch and pushes a blob of ``push_bytes``. Stateless: on restart the
    parameter server's latest version says how far it got."""

    label = "simulated trainer (step-time model)"

    def __init__(self, seconds_per_step: float, seconds_per_token: float, push_bytes: int, speed: float,
                 stop: threading.Event):
        self.seconds_per_step = seconds_per_step
        self.seconds_per_token = seconds_per_token
        self.push_bytes = push_bytes
        self.speed = speed
        self.stop = stop

    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        tokens = sum(len(t["tokens"]) for t in batch["trajectories"])
        seconds = self.seconds_per_step + self.seconds_per_token * tokens
        self.stop.wait(seconds / self.speed)  # the modelled training time
        return {"train_seconds": seconds}

    def weights(self, version: int) -> Mapping[str, Any]:
        return {"weights": np.full(self.push_bytes, version % 256, np.uint8)}
