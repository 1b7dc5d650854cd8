"""Measuring trainer steps: seconds, trained tokens/s, peak memory, MFU, and the time spent in a
section of the step (the log-prob head).

The production trainer role wraps its backend in ``MeteredBackend`` (the job's tracking logs the
numbers as ``train/*``); ``staleflow bench trainer`` (``staleflow.training.bench``) uses the same
meter, and ``SectionTimer`` for the head's share of the step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from staleflow.host import status_kib
from staleflow.training.base import ShardedWeights, TrainerBackend

PEAK_BF16_TFLOPS = (  # dense bf16 tensor-core peaks, per GPU; first match of the device's name wins
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)


def peak_tflops_of(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``), if the table knows it."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in device_name.lower()), None)


def model_flops_utilization(parameters: int, tokens_per_second: float, peak_tflops: float, world_size: int) -> float:
    """6N FLOPs per trained token (forward 2N, backward 4N) against the GPUs' dense peak."""
    return 6.0 * parameters * tokens_per_second / (peak_tflops * 1e12 * world_size)


def trained_tokens(batch: Mapping[str, Any]) -> int:
    return sum(len(t["prompt_ids"]) + len(t["tokens"]) for t in batch["trajectories"])


class Memory:
    """One rank's memory: allocated device memory on a GPU, the process's resident set on CPU
    (its high-water mark reset through ``/proc/self/clear_refs``)."""

    def __init__(self, device: Any):
        self.device = device
        self.kind = "device memory allocated" if device.type == "cuda" else "process RSS"

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def current(self) -> int:
        if self.device.type == "cuda":
            import torch

            return int(torch.cuda.memory_allocated(self.device))
        return _status_kib("VmRSS") * 1024

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)

    def peak(self) -> int:
        if self.device.type == "cuda":
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return _status_kib("VmHWM") * 1024


def _status_kib(key: str) -> int:
    kib = status_kib(key)
    if kib is None:
        raise RuntimeError(f"/proc/self/status has no {key}")
    return kib


class StepMeter:
    """One rank's per-step seconds, trained tokens/s, peak memory and MFU (on a known GPU)."""

    def __init__(self, device: Any, parameters: int, world_size: int, peak_tflops: float | None = None):
        self.memory = Memory(device)
        self.parameters, self.world_size = parameters, world_size
        if peak_tflops is None and device.type == "cuda":
            import torch

            peak_tflops = peak_tflops_of(torch.cuda.get_device_name(device))
        self.peak_tflops = peak_tflops
        self._started = 0.0

    def start(self) -> None:
        self.memory.synchronize()
        self.memory.reset_peak()
        self._started = time.perf_counter()

    def stop(self, tokens: int) -> dict[str, float]:
        self.memory.synchronize()
        seconds = time.perf_counter() - self._started
        numbers = {"step_seconds": seconds, "tokens_per_second": tokens / seconds,
                   "peak_memory_bytes": float(self.memory.peak())}
        mfu = self.mfu(tokens / seconds)
        if mfu is not None:
            numbers["mfu"] = mfu
        return numbers

    def mfu(self, tokens_per_second: float) -> float | None:
        if self.peak_tflops is None or self.memory.device.type != "cuda":
            return None
        return model_flops_utilization(self.parameters, tokens_per_second, self.peak_tflops, self.world_size)


class SectionTimer:
    """Seconds spent inside a section of a step, summed over its intervals (``begin`` / ``end``
    pairs, possibly many per step, forward and backward). On CUDA the ends are events recorded on
    the current stream: nothing waits while the step runs, and ``seconds`` synchronises once. On
    CPU, ``time.perf_counter``."""

    def __init__(self, device: Any):
        self.device = device
        self._open: Any = None
        self._intervals: list[tuple[Any, Any]] = []

    def _mark(self) -> Any:
        if self.device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self._open = self._mark()

    def end(self) -> None:
        if self._open is not None:
            self._intervals.append((self._open, self._mark()))
            self._open = None

    def seconds(self) -> float:
        """The intervals so far, summed, and the timer emptied for the next step."""
        if self.device.type == "cuda" and self._intervals:
            import torch

            torch.cuda.synchronize(self.device)
            total = sum(start.elapsed_time(stop) for start, stop in self._intervals) / 1000.0
        else:
            total = sum(stop - start for start, stop in self._intervals)
        self._intervals = []
        return float(total)


class MeteredBackend(TrainerBackend):
    """A trainer backend whose ``train`` metrics also carry the step's ``step_seconds``,
    ``tokens_per_second`` (trained prompt + response tokens), ``peak_memory_bytes`` (rank 0) and
    ``mfu`` (on a GPU the peak table knows): the job's tracking logs them as ``train/*``."""

    def __init__(self, inner: TrainerBackend, meter: StepMeter):
        self.inner, self.meter = inner, meter
        self.label = inner.label

    @classmethod
    def around(cls, driver: Any) -> MeteredBackend:
        """Around a ``RankDriver`` (its ``local`` is rank 0's ``FsdpBackend``)."""
        local = driver.local
        return cls(driver, StepMeter(local.device, sum(p.numel() for p in local.model.parameters()), local.world))

    def resume_version(self) -> int | None:
        return self.inner.resume_version()

    def train(self, version: int, batch: Mapping[str, Any]) -> dict[str, float]:
        self.meter.start()
        metrics = self.inner.train(version, batch)
        return {**metrics, **self.meter.stop(trained_tokens(batch))}

    def weights(self, version: int) -> Mapping[str, Any] | ShardedWeights:
        return self.inner.weights(version)

    def checkpoint(self, version: int) -> bool:
        return self.inner.checkpoint(version)

    def close(self) -> None:
        self.inner.close()
