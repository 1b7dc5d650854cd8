"""A sharded trainer rank's export of its share of a version: in the dtype the engine loads, into
reusable host buffers, overlapped with the next training step.

``ShareStaging.export`` copies each local shard (cast to the export dtype) into a host buffer it
keeps from one version to the next. With CUDA the buffers are pinned and the copies run on a side
stream: ``export`` returns at once, the pusher waits for the copies (``ShardedWeights.wait_ready``)
and the training stream waits only before it writes the exported parameters in place
(``before_update``, hooked before the optimizer step). On CPU the copies are synchronous.

A buffer is reused only once no share that points into it is alive any more: a rank keeps its
last pushed share until the parameter server persisted it, and may push it again meanwhile, so the
next version never lands in the bytes of a share that can still be pushed.

Why this is not ``staleflow.transports.staging.FlatStaging`` (the bench's and a staged pull's
flat buffer): see that module's docstring; the two share the buffer layout (``host_layout``).
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from staleflow.training.base import ShardedWeights
from staleflow.transports.client import ShardPiece, safetensors_dtype_of
from staleflow.transports.staging import host_layout

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""What ``trainer.export_dtype`` names; ``auto`` keeps each parameter's own dtype."""
ROLLOUT_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                       "float": "float32"}
"""vLLM's ``dtype`` spellings of the dtypes an export can take; any other (``auto``) keeps the trainer's."""
PIECE_ALIGN = 64  # where each piece starts in a staging buffer


def export_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``trainer.export_dtype`` (None: keep each parameter's own dtype)."""
    if name == "auto":
        return None
    if name not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {name!r}: use auto or one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


@dataclass(frozen=True)
class LocalShard:
    """A tensor's rows that this rank holds: ``local`` is rows ``[row, row + len(local))`` of a
    tensor of ``full_shape`` (all of it for a replicated or unsharded tensor)."""

    name: str
    full_shape: tuple[int, ...]
    row: int
    local: torch.Tensor


def local_shards(state: Mapping[str, Any], rank: int, drop: Iterable[str] = ()) -> list[LocalShard]:
    """This rank's share of a (possibly DTensor) state dict: its dim-0 shard of each sharded
    tensor, and the replicated and plain tensors on rank 0. No gather: placements other than
    dim-0 shards are refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dropped = set(drop)
    shards = []
    for name, value in state.items():
        if name in dropped:
            continue
        full_shape = tuple(value.shape)
        if not isinstance(value, DTensor):
            shards.append(LocalShard(name, full_shape, 0, value.detach() if rank == 0 else _nothing_of(value)))
            continue
        placements = tuple(value.placements)
        if any(not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and p.dim != 0) for p in placements):
            raise ValueError(f"{name}: placements {placements} are not dim-0 shards; cannot push it without a gather")
        local = value.to_local().detach()
        if not any(isinstance(p, Shard) for p in placements):
            shards.append(LocalShard(name, full_shape, 0, local if rank == 0 else _nothing_of(local)))
            continue
        local_shape, offset = compute_local_shape_and_global_offset(full_shape, value.device_mesh, placements)
        if tuple(local.shape) != tuple(local_shape):  # padded storage: keep the real rows only
            local = local[: local_shape[0]]
        shards.append(LocalShard(name, full_shape, offset[0] if local.numel() else 0, local))
    return shards


def _nothing_of(tensor: torch.Tensor) -> torch.Tensor:
    """No element of ``tensor`` (another rank pushes it), in its dtype."""
    return tensor.detach().reshape(-1)[:0]


class _Buffer:
    """One reusable host buffer and the share that points into it (held weakly)."""

    def __init__(self, nbytes: int, pinned: bool):
        self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.holder: weakref.ref[ShardedWeights] | None = None

    def in_use(self) -> bool:
        return self.holder is not None and self.holder() is not None


class ShareStaging:
    """A rank's reusable host buffers and the copies of its share into them (see the module doc)."""

    def __init__(self, part: int, parts: int, dtype: torch.dtype | None, device: torch.device | None = None):
        self.part, self.parts, self.dtype = part, parts, dtype
        self.device = device or torch.device("cpu")
        self.asynchronous = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if self.asynchronous else None
        self._buffers: list[_Buffer] = []
        self._copied: torch.cuda.Event | None = None  # the last export's copies, still reading the parameters
        self._reading: list[torch.Tensor] = []  # what those copies read, alive until the event is waited

    @property
    def buffers(self) -> int:
        """Host buffers allocated so far (two in steady state: the kept share's and the next)."""
        return len(self._buffers)

    def export(self, shards: list[LocalShard]) -> ShardedWeights:
        """This rank's share: every shard cast to the export dtype, in a buffer no live share uses."""
        share = ShardedWeights(self.part, self.parts, {})
        held: list[tuple[LocalShard, torch.dtype]] = []
        for shard in shards:
            dtype = self._dtype_of(shard.local)
            share.tensors[shard.name] = (safetensors_dtype_of(torch.empty(0, dtype=dtype)), shard.full_shape)
            if shard.local.numel():
                held.append((shard, dtype))
        offsets, size = host_layout([shard.local.numel() * dtype.itemsize for shard, dtype in held], PIECE_ALIGN)
        placed = [(start, shard, dtype) for start, (shard, dtype) in zip(offsets, held, strict=True)]
        buffer = self._free_buffer(size)
        buffer.holder = weakref.ref(share)
        targets = []
        for start, shard, dtype in placed:
            target = buffer.data[start:start + shard.local.numel() * dtype.itemsize].view(dtype).view(shard.local.shape)
            row_bytes = dtype.itemsize * math.prod(shard.full_shape[1:])
            share.pieces.append(ShardPiece(shard.name, shard.row * row_bytes, target))
            targets.append((target, shard.local))
        if self._stream is None:
            for target, source in targets:
                target.copy_(source)
            return share
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the step that produced them is done
        with torch.cuda.stream(self._stream):
            for target, source in targets:
                target.copy_(source.to(target.dtype), non_blocking=True)  # cast on the GPU: fewer bytes cross
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copied, self._reading = copied, [source for _, source in targets]
        share.ready = copied.synchronize
        return share

    def before_update(self) -> None:
        """Before anything writes the exported parameters in place (the optimizer step): the
        training stream waits for the copies still reading them; the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            self._copied, self._reading = None, []

    def _dtype_of(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype

    def _free_buffer(self, nbytes: int) -> _Buffer:
        if self._buffers and all(buffer.in_use() for buffer in self._buffers):
            gc.collect()  # a share let go inside a reference cycle (a retried push's traceback) is gone only then
        for i, buffer in enumerate(self._buffers):
            if not buffer.in_use():
                if buffer.data.numel() < nbytes:
                    buffer = self._buffers[i] = _Buffer(nbytes, self.asynchronous)
                return buffer
        buffer = _Buffer(nbytes, self.asynchronous)
        self._buffers.append(buffer)
        return buffer
