"""Device tensors <-> one flat (pinned) host buffer, in one copy each way.

A trainer rank's shards and an engine's parameters are hundreds or thousands of separate device
tensors. Copying them one by one costs a launch and a synchronization point per tensor. The plan
here is made once per set of tensors and reused every version: the tensors' bytes are gathered
on the device into one flat buffer (``torch.cat``: one kernel) and copied to the host in one
transfer (and the reverse: one transfer, then ``torch._foreach_copy_`` scatters the flat buffer
into the tensors in one fused call). The host side is one pinned buffer, so the transfer runs at
the bus's speed, and the parameter server's pushes and pulls see one contiguous region.

The device-side flat buffer costs the tensors' bytes once more in device memory. Without CUDA
the same plan runs on CPU tensors (pinned memory needs CUDA; the host buffer is then plain).

Why the trainer's export (``staleflow.training.export.ShareStaging``) is a class of its own and
shares only :func:`host_layout` with this one: it casts each shard to the engine's dtype on the
way out, copies on a side stream that the next step overlaps (this class synchronizes), moves
bytes one way only, and keeps several host buffers, each reused only once no share it backs can
still be pushed (this class has one buffer, reused at every call). It also copies shard by shard
rather than gathering on the device first, because a trainer's device memory has no room for a
second copy of its share, while the bench and an engine's staged pull can afford it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def host_layout(sizes: Sequence[int], align: int = 1) -> tuple[list[int], int]:
    """(offsets, total bytes) of items of ``sizes`` bytes placed in order in one buffer, each
    starting at a multiple of ``align``."""
    offsets, total = [], 0
    for size in sizes:
        total += -total % align
        offsets.append(total)
        total += size
    return offsets, total


class FlatStaging:
    """One flat host buffer standing for ``tensors`` (contiguous tensors on one device), their
    bytes back to back in the given order. ``to_host`` gathers them into it, ``to_device``
    scatters it back. ``offsets[i]`` is where tensor ``i``'s bytes start in ``host``."""

    def __init__(self, tensors: Sequence[Any]):
        import torch

        if not tensors:
            raise ValueError("FlatStaging needs at least one tensor")
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            raise ValueError("FlatStaging: every tensor must be on one device")
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("FlatStaging: tensors must be contiguous")
        self.device = device
        self._views = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.sizes = [v.numel() for v in self._views]
        self.offsets, self.nbytes = host_layout(self.sizes)  # back to back, like a data section
        pinned = device.type == "cuda"
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._device_flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._device_parts = list(torch.split(self._device_flat, self.sizes))

    def host_array(self) -> np.ndarray:
        """The host buffer as a numpy array (no copy)."""
        return self.host.numpy()

    def to_host(self) -> None:
        """The tensors' current bytes into ``host``; returns once they are there."""
        import torch

        torch.cat(self._views, out=self._device_flat)
        self.host.copy_(self._device_flat, non_blocking=self.device.type == "cuda")
        self._synchronize()

    def to_device(self) -> None:
        """``host``'s bytes into the tensors; returns once they are there."""
        import torch

        self._device_flat.copy_(self.host, non_blocking=self.device.type == "cuda")
        torch._foreach_copy_(self._views, self._device_parts)  # pyright: ignore[reportPrivateImportUsage]  (not in torch.__all__)
        self._synchronize()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
