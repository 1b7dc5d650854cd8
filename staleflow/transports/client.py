"""The parameter server's client (``ParamsClient``): push from numpy arrays, torch tensors or raw bytes,
pull over any transport into fresh or preallocated buffers, verified chunk by chunk (checksums, or
over shared memory the slot's generation stamp)."""

from __future__ import annotations

import contextlib
import operator
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import numpy as np

from staleflow.api.base import Client, ServiceError
from staleflow.api.params import ParamsHealth, StoreDescription, VersionDeleted, VersionSummary
from staleflow.api.params import ParamsRoutes as API
from staleflow.errors import ErrorCode
from staleflow.transports.base import PullLease, PushSession, Transport
from staleflow.transports.checksums import checksum_algorithms, chunk_hasher, verify_mode
from staleflow.transports.dtypes import numpy_dtype, safetensors_dtype
from staleflow.transports.errors import ChecksumMismatch, FormatError
from staleflow.transports.http import HttpTransport
from staleflow.transports.layout import ChunkSpec, Manifest, TensorSpec, laid_table
from staleflow.transports.peers import PeerTransport, reference_sources, ros_lease
from staleflow.transports.regions import ByteRegions, merge_ranges
from staleflow.transports.selection import Selection, SelectionPlan, copy_blocks, plan_selection, window_lease
from staleflow.transports.shm import ShmTransport, host_id


@dataclass(frozen=True)
class ShardPiece:
    """Part of a tensor that one pusher holds: bytes ``[start, start + len(data))`` of tensor
    ``name``'s full row-major bytes (an FSDP rank's dim-0 shard is one such piece)."""

    name: str
    start: int
    data: Any  # numpy array, CPU torch tensor or any buffer

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) if hasattr(self.data, "nbytes") else memoryview(self.data).nbytes


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as raw bytes, for dtypes the caller has no array type for (e.g. BF16)."""

    dtype: str
    shape: tuple[int, ...]
    data: Any  # any buffer: bytes, bytearray, memoryview, numpy array


def _as_bytes(value: Any) -> tuple[str, tuple[int, ...], Any]:
    """(safetensors dtype, shape, a buffer holding the bytes) for numpy arrays, torch tensors and
    RawTensor; no copy for contiguous CPU data."""
    if isinstance(value, RawTensor):
        return value.dtype, tuple(value.shape), value.data
    if type(value).__module__.startswith("torch"):
        return _torch_bytes(value)
    array = np.asarray(value)
    return safetensors_dtype(array.dtype), array.shape, np.ascontiguousarray(array)


_TORCH_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                 "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                 "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64"}


def _torch_bytes(tensor: Any) -> tuple[str, tuple[int, ...], Any]:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise FormatError(f"torch dtype {tensor.dtype} has no safetensors equivalent")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return _TORCH_DTYPES[name], tuple(tensor.shape), flat.view(torch.uint8).numpy()


def safetensors_dtype_of(value: Any) -> str:
    """The safetensors dtype of a numpy array or torch tensor."""
    if type(value).__module__.startswith("torch"):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise FormatError(f"torch dtype {value.dtype} has no safetensors equivalent")
        return _TORCH_DTYPES[name]
    return safetensors_dtype(np.asarray(value).dtype)


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of a safetensors dtype."""
    import torch

    return getattr(torch, {v: k for k, v in _TORCH_DTYPES.items()}[dtype])


def _as_torch(array: np.ndarray, spec: TensorSpec, shape: tuple[int, ...] | None = None) -> Any:
    import torch

    dtype = torch_dtype(spec.dtype)
    raw = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return raw.view(dtype).reshape(spec.shape if shape is None else shape)


class ParamsClient(Client):
    """The parameter server's API for the trainer (push), the instances (pull) and the coordinator
    (versions, latest), over the routes ``staleflow.api.params`` declares; its replies are plain
    JSON data. Not thread-safe: one per thread. ``token`` (default: $STALEFLOW_TOKEN) is
    sent with every request, as the services' bearer-token check wants it for pushes.
    ``remote_push``: how an ``auto`` push goes when the PS runs on another host (``http``, or
    ``nixl`` where the hosts have RDMA between them); on the PS's host it goes over ``shm``."""

    # A selected pull over http (or nixl) receives the chunks it touches into a scratch buffer of
    # this size (at least one chunk) and copies the selected bytes out of it.
    selection_scratch_bytes = 64 << 20

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None, remote_push: str = "http",
                 puller_id: str | None = None, zone: str = ""):
        super().__init__(url, token, timeout)
        # a pull with sources="ros" names itself to the reference server (its load accounting) and its zone
        self.puller_id = puller_id or f"puller-{uuid.uuid4().hex[:12]}"
        self.zone = zone
        if remote_push not in ("http", "nixl"):
            raise ValueError(f"remote_push {remote_push!r}: use http or nixl")
        self.timeout = timeout
        self.remote_push = remote_push
        self._transports: dict[str, Transport] = {}
        self._health: ParamsHealth | None = None
        self._tables_sent: set[str] = set()  # digests of the tensor tables this client sent the PS
        self._last_table: tuple[dict, list, str, dict[str, TensorSpec]] | None = None
        self._last_source: tuple[dict[str, TensorSpec], tuple[ShardPiece, ...], ByteRegions, list] | None = None
        self._last_pull_regions: tuple[tuple[TensorSpec, ...], list[Any], ByteRegions] | None = None

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        super().close()

    def transport(self, name: str) -> Transport:
        if name not in self._transports:
            if name == "http":
                self._transports[name] = HttpTransport(self.url, self.timeout, self._auth(), self._data_url)
            elif name == "shm":
                self._transports[name] = ShmTransport()
            elif name == "ros":
                self._transports[name] = PeerTransport(reference_sources(self, self.puller_id, host_id(), self.zone),
                                                       lambda refresh: self._data_url(refresh) or self.url, self.timeout,
                                                       self._auth())
            elif name == "nixl":
                from staleflow.transports.nixl import NixlTransport

                self._transports[name] = NixlTransport()
            else:
                raise ValueError(f"unknown transport {name!r}: use http, shm or nixl")
        return self._transports[name]

    def _auth(self) -> dict[str, str]:
        return {"Authorization": self.http.headers["authorization"]} if "authorization" in self.http.headers else {}

    # -- queries

    def health(self) -> ParamsHealth:
        return self.send(API.health, API.health.request())

    def versions(self, timeout: float | None = None) -> StoreDescription:
        return self.send(API.versions, API.versions.request(timeout=timeout))

    def latest(self) -> VersionSummary:
        return self.send(API.latest, API.latest.request())

    def manifest(self, version: int | str = "latest") -> Manifest:
        return Manifest.from_json(self.json(API.manifest, version))

    # -- push (trainer)

    def push(self, version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
             metadata: Mapping[str, str] | None = None, transport: str = "auto") -> dict:
        """Store ``tensors`` (numpy arrays, torch tensors or RawTensor) as ``version`` and return
        once it is visible, with its summary. The bytes go from the caller's buffers straight into
        the PS's memory (``shm``; ``auto`` picks it on the PS's host) or chunk by chunk over HTTP;
        never copied whole."""
        # a Mapping is also an Iterable: say which one the signature means
        items = list(cast(Mapping[str, Any], tensors).items()) if isinstance(tensors, Mapping) else list(tensors)
        converted = [(name, *_as_bytes(value)) for name, value in items]
        table = {n: (d, tuple(s)) for n, d, s, _ in converted}
        pieces = [ShardPiece(n, 0, buf) for n, _, _, buf in converted]
        reply = self.push_part(version, 0, 1, table, pieces, metadata=metadata, transport=transport)
        if not reply.get("visible"):
            raise ServiceError(409, f"version {version} did not become visible: {reply}")
        return reply

    def push_part(self, version: int, part: int, parts: int, tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                  pieces: Iterable[ShardPiece], *, metadata: Mapping[str, str] | None = None,
                  transport: str = "auto", wait_s: float = 0.0) -> dict:
        """Push this pusher's share of ``version``, pushed in ``parts`` parts (e.g. one per
        trainer rank, all at once). ``tensors``: the whole table, name -> (safetensors dtype,
        shape), the same on every part; ``pieces``: the bytes this part holds. The PS makes the
        version visible when every part is done and the parts cover every byte. Over ``shm``
        (``auto`` on the PS's host) the bytes are copied straight into the PS's memory, else sent
        over HTTP; ``nixl`` (asked for, or ``auto`` off the PS's host with ``remote_push="nixl"``)
        WRITEs them into the PS's memory with NIXL and the PS verifies what landed. Returns the PS's answer:
        ``visible`` says whether the version is visible (after waiting up to ``wait_s`` for the
        other parts)."""
        table, digest, laid = self._laid(tensors)
        source, ranges = self._push_source(laid, pieces)
        via = transport
        if via == "auto":  # on the PS's host shm is fastest; elsewhere only the caller knows whether RDMA is there
            via = "shm" if self._shm_here() else self.remote_push
        mover = self.transport(via)  # before joining: a transport this host lacks fails here, leaving no push behind
        join = {"metadata": dict(metadata or {}), "parts": parts, "ranges": ranges, "via": via, "gather": True,
                "table": digest}

        def with_tensors() -> dict:
            return {**join, "tensors": [{"name": n, "dtype": d, "shape": s} for n, d, s in table]}

        if digest in self._tables_sent:  # a table this PS was sent before is named by its digest, not sent again
            try:
                begin = self.json(API.join_part, version, part, **join)
            except ServiceError as exc:
                if exc.code is not ErrorCode.UNKNOWN_TABLE:  # else a restarted PS: send the table
                    raise
                begin = self.json(API.join_part, version, part, **with_tensors())
        else:
            begin = self.json(API.join_part, version, part, **with_tensors())
        self._tables_sent.add(digest)
        algorithm = next(a for a in begin["checksum_algorithms"] + ["crc32"] if a in checksum_algorithms())
        session = PushSession(begin["push_id"], version, tuple(ChunkSpec.from_json(c) for c in begin["chunks"]), algorithm,
                              part=part, details=begin["details"])
        checksums = mover.push(session, source)
        delivered = time.monotonic()  # the bytes are in; the PS is told next
        reply = self.finish_part(version, part, session.push_id, checksums=checksums, wait_s=wait_s)
        return {**reply, "via": via, "delivered_at_monotonic": delivered}

    def _push_source(self, laid: dict[str, TensorSpec], pieces: Iterable[ShardPiece]) -> tuple[ByteRegions, list]:
        """(the data section as ``pieces``' buffers, the byte ranges they cover) for a table laid
        out as ``laid``. The last one is kept: a pusher that hands the same pieces again (the
        same objects, holding numpy arrays, whose memory cannot move while viewed) gets it back
        with one identity check per piece, and with it the cut of its chunks into copy windows
        (``ByteRegions.windows``), instead of a view, a check and a window slot per tensor."""
        pieces = tuple(pieces)
        cached = self._last_source
        if (cached is not None and cached[0] is laid and len(cached[1]) == len(pieces)
                and all(map(operator.is_, pieces, cached[1]))):
            return cached[2], cached[3]
        spans = []
        for piece in pieces:
            spec = laid.get(piece.name)
            if spec is None:
                raise FormatError(f"piece of {piece.name!r}: no such tensor in the table")
            view = _byte_view_of(piece.data)
            if piece.start < 0 or piece.start + len(view) > spec.nbytes:
                raise FormatError(f"piece of {piece.name!r} covers bytes {piece.start}..{piece.start + len(view)}, "
                                  f"outside the tensor's {spec.nbytes}")
            if len(view):
                spans.append((spec.offset + piece.start, view))
        spans.sort(key=lambda span: span[0])
        source = ByteRegions(spans, sum(t.nbytes for t in laid.values()))
        ranges = merge_ranges((offset, len(view)) for offset, view in spans)  # one for a one-rank table
        # only buffers viewed in place: a piece copied on the way (a non-contiguous array, a torch
        # tensor off the CPU) would hand its bytes of this push to the next
        reusable = all(type(p.data) is np.ndarray and p.data.flags.c_contiguous for p in pieces)
        self._last_source = (laid, pieces, source, ranges) if reusable else None
        return source, ranges

    def _laid(self, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[list, str, dict[str, TensorSpec]]:
        """(the table as the join sends it, its digest, name -> its layout) for ``tensors``; the
        last table pushed is kept, and an equal mapping (one comparison in C: a trainer pushes the
        same table every version) skips the walk over its thousands of entries."""
        cached = self._last_table
        if cached is not None and cached[0] == tensors:
            return cached[1], cached[2], cached[3]
        table = [(name, dtype, list(shape)) for name, (dtype, shape) in tensors.items()]
        laid_tuple, digest = laid_table(table)
        # shapes as tuples: a mapping with list shapes (which can change in place) never equals it
        snapshot = {name: (dtype, tuple(shape)) for name, (dtype, shape) in tensors.items()}
        self._last_table = (snapshot, table, digest, {t.name: t for t in laid_tuple})
        return table, digest, self._last_table[3]

    def finish_part(self, version: int, part: int, push_id: str, *, checksums: Mapping[int, str | list[str]] | None = None,
                    wait_s: float = 0.0) -> dict:
        """Tell the PS that part ``part`` of ``version`` is in (with its chunks' checksums when it
        wrote them itself, over shm or NIXL); waits up to ``wait_s`` for the version to be visible.
        Called again on a part that is done, it only waits."""
        return self.json(API.finish_part, version, part, push_id=push_id, checksums=checksums, wait_s=wait_s,
                         timeout=self.timeout + wait_s)

    def _server_health(self, refresh: bool = False) -> ParamsHealth:
        """The PS's health answer, asked once per client unless ``refresh`` (a restarted PS may
        have another data port)."""
        if self._health is None or refresh:
            self._health = self.health()
        return self._health

    def _shm_here(self) -> bool:
        """The PS offers shared memory and runs on this host."""
        health = self._server_health()
        return health.host_id == host_id() and "shm" in health.transports

    def _data_url(self, refresh: bool = False) -> str | None:
        """The PS's data plane: its ``data_port`` on the host this client reaches the PS at."""
        port = self._server_health(refresh).data_port
        if not port:
            return None
        parts = urlsplit(self.url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return f"{parts.scheme}://{host}:{port}"

    def delete_version(self, version: int) -> VersionDeleted:
        """Withdraw ``version`` from the PS (it goes once the pulls reading it end)."""
        return self.send(API.delete_version, API.delete_version.request(version))

    def abort_push(self, version: int, push_id: str) -> None:
        """Drop an unfinished push of ``version`` (left by a killed pusher); one that is gone already is no error."""
        with contextlib.suppress(ServiceError):
            self.json(API.abort_push, version, push_id=push_id)

    def wait_persisted(self, version: int, timeout_s: float) -> bool:
        """True once ``version`` is persisted on the PS's disk (False when ``timeout_s`` ran out)."""
        reply = self.json(API.persisted, version, wait_s=timeout_s, timeout=self.timeout + timeout_s)
        return bool(reply["persisted"])

    # -- pull (instances)

    def open_pull(self, version: int | str = "latest", transport: str = "http", wait_s: float = 0.0,
                  sources: str = "ps") -> PullLease:
        """A lease on ``version`` for ``receive``; ``transport="auto"`` as in ``iter_pull``.
        ``sources="ros"``: from the version's holders, chunk by chunk, each holder read over
        ``transport`` where it can (``auto``: shm on its host, else nixl where both offer it; see
        ``peer_reads``), else over http."""
        if sources == "ros":
            return ros_lease(self.json(API.reference_manifest, version), self.puller_id, peers=transport)
        if sources != "ps":
            raise ValueError(f"sources {sources!r}: use ps or ros")
        if transport == "auto":
            return self._open_auto(version, wait_s)
        body = self.json(API.open_pull, version, transport=transport, wait_s=wait_s, timeout=self.timeout + wait_s)
        return PullLease(body["lease_id"], Manifest.from_json(body["manifest"]), body["transport"],
                         body["details"], body["ttl_s"])

    def close_pull(self, lease: PullLease) -> None:
        with contextlib.suppress(httpx.HTTPError, ServiceError):  # else the lease lapses on its own
            if lease.transport == "ros":  # no lease: the source's load assignment ends
                self.json(API.release_puller, self.puller_id)
            else:
                self.json(API.close_pull, lease.lease_id)

    def _open_auto(self, version: int | str, wait_s: float) -> PullLease:
        """shm when the PS offers it and runs on this host, else http."""
        try:
            lease = self.open_pull(version, "shm", wait_s)
        except ServiceError as exc:
            if exc.code is not ErrorCode.TRANSPORT_DISABLED:  # shm not enabled there
                raise
        else:
            if lease.details.get("host_id") == host_id():
                return lease
            self.close_pull(lease)
        return self.open_pull(version, "http", wait_s)

    def iter_pull(self, version: int | str = "latest", transport: str = "http", *, out: Mapping[str, Any] | None = None,
                  as_torch: bool = False, verify: bool | str = "auto", wait_s: float = 0.0,
                  select: Selection | None = None, into: Any = None, sources: str = "ps") -> Iterator[tuple[str, Any]]:
        """Yields (name, tensor) as each tensor's chunks have landed and been verified. Into
        ``out`` (name -> preallocated array of the right size) if given, else into one new buffer
        of the version's size. ``transport="auto"`` picks shm on the PS's host, http elsewhere.
        ``select``: only these tensors, each whole or one tensor-parallel slice (see ``receive``).
        ``into``: one flat buffer of the version's size to pull into instead (see ``receive``).
        ``sources="ros"``: from the holders of the version (reference-oriented storage), each
        chunk from the source the parameter server names, verified, retried elsewhere on failure."""
        lease = self.open_pull(version, transport, wait_s, sources)
        try:
            yield from self.receive(lease, out=out, as_torch=as_torch, verify=verify, select=select, into=into)
        finally:
            self.close_pull(lease)

    def pull(self, version: int | str = "latest", transport: str = "http", *, out: Mapping[str, Any] | None = None,
             as_torch: bool = False, verify: bool | str = "auto", wait_s: float = 0.0,
             select: Selection | None = None, into: Any = None, sources: str = "ps") -> dict[str, Any]:
        """The whole state dict of ``version`` (a number, 'latest' or 'latest-N'), or the part of
        it ``select`` names."""
        return dict(self.iter_pull(version, transport, out=out, as_torch=as_torch, verify=verify, wait_s=wait_s,
                                   select=select, into=into, sources=sources))

    def receive(self, lease: PullLease, *, out: Mapping[str, Any] | None = None, as_torch: bool = False,
                verify: bool | str = "auto", select: Selection | None = None, into: Any = None) -> Iterator[tuple[str, Any]]:
        """The tensors of an open lease (see ``open_pull``), as ``iter_pull`` yields them.

        ``select`` pulls only some tensors: a mapping name -> ``None`` (whole) or ``TensorSlice``
        (one tensor-parallel part), a list of names, or a callable that takes the manifest and
        returns one of those (``select_prefix``, ``select_where``). Tensors then come with their
        selected shapes, and ``out`` needs a buffer of that shape for each selected tensor. Every
        chunk the selected bytes come from is verified as in a whole pull.

        ``into``: a writable C-contiguous buffer (numpy array or CPU torch tensor, e.g. a pinned
        staging buffer kept across versions) of exactly the version's data-section bytes; the
        whole data section lands in it as one region and the tensors come back as views of it.

        ``verify``: ``"auto"`` (the default) checks every chunk's checksum over http and nixl, and
        over shm the slot's generation stamp, before and after the copy (the bytes were checksummed
        once as they entered the PS's memory; see docs/params.md); ``"checksum"`` (or True) hashes
        every byte on every transport; ``"none"`` (or False) checks nothing. A tensor is yielded
        only once its bytes passed."""
        verify = verify_mode(verify)
        if into is not None and (out is not None or select is not None):
            raise FormatError("give one of into=, out= and select=")
        if select is not None:
            yield from self._receive_selected(lease, select, out, as_torch, verify)
            return
        manifest = lease.manifest
        if out is not None:
            regions = self._pull_regions(manifest.tensors, out)
        else:
            flat = np.empty(manifest.total_bytes, np.uint8) if into is None else _flat_target(into, manifest.total_bytes)
            arrays = {t.name: _view_of(flat, t) for t in manifest.tensors}
            regions = ByteRegions.flat(flat)
        pending = sorted(manifest.tensors, key=lambda t: t.offset + t.nbytes)
        next_tensor = 0
        for verified_end in _verified_prefixes(self.transport(lease.transport), lease, regions, verify):
            while next_tensor < len(pending) and pending[next_tensor].offset + pending[next_tensor].nbytes <= verified_end:
                spec = pending[next_tensor]
                next_tensor += 1
                if out is not None:
                    yield spec.name, out[spec.name]
                else:
                    yield spec.name, _as_torch(arrays[spec.name], spec) if as_torch else arrays[spec.name]

    def _pull_regions(self, tensors: tuple[TensorSpec, ...], out: Mapping[str, Any]) -> ByteRegions:
        """``out``'s buffers as the data section of a version of ``tensors``. The last one is
        kept: an instance pulling every version into the same numpy arrays gets it back (and with
        it the cut of its chunks into copy windows) with one lookup and identity check per tensor."""
        cached = self._last_pull_regions
        if cached is not None and cached[0] == tensors:
            try:
                held = [out[t.name] for t in tensors]
            except KeyError:
                held = None
            if held is not None and all(map(operator.is_, held, cached[1])):
                return cached[2]
        arrays = {t.name: _writable_array(out, t) for t in tensors}
        regions = ByteRegions.per_tensor(tensors, arrays)
        held = [out[t.name] for t in tensors]
        # numpy arrays only: a torch tensor's storage can be swapped under the view kept here
        reusable = all(type(a) is np.ndarray for a in held)
        self._last_pull_regions = (tensors, held, regions) if reusable else None
        return regions

    def _receive_selected(self, lease: PullLease, select: Selection, out: Mapping[str, Any] | None, as_torch: bool,
                          verify: str) -> Iterator[tuple[str, Any]]:
        plan = plan_selection(lease.manifest, select)
        if out is not None:
            targets = [_selected_target(out, t.name, t.spec.dtype, t.shape, t.nbytes) for t in plan.tensors]
            arrays = [out[t.name] for t in plan.tensors]
        else:
            flat = np.empty(plan.buffer_bytes, np.uint8)
            targets = [flat[t.target_offset:t.target_offset + t.nbytes] for t in plan.tensors]
            arrays = [_shaped(target, t.spec, t.shape) for target, t in zip(targets, plan.tensors, strict=True)]
        transport = self.transport(lease.transport)
        if isinstance(transport, ShmTransport):
            verified_ends = transport.pull_selected(lease, plan, targets, verify)
        else:
            verified_ends = _pull_windows(transport, lease, plan, targets, verify, self.selection_scratch_bytes)
        pending = sorted(range(len(plan.tensors)), key=lambda i: (plan.tensors[i].region.end, i))
        next_tensor = 0
        for verified_end in (0, *verified_ends, None):  # None: every touched chunk is done
            while next_tensor < len(pending):
                position = pending[next_tensor]
                selected = plan.tensors[position]
                if verified_end is not None and selected.region.end > verified_end:
                    break
                next_tensor += 1
                if out is None and as_torch:
                    yield selected.name, _as_torch(arrays[position], selected.spec, selected.shape)
                else:
                    yield selected.name, arrays[position]


def _verified_prefixes(transport: Transport, lease: PullLease, into: ByteRegions, verify: str) -> Iterator[int]:
    """Runs the transport; yields the end of the data section verified so far after each chunk
    (``verify``: a ``verify_mode``; only shm has a check other than the checksums)."""
    chunks = lease.manifest.chunks
    yield 0  # zero-size tensors at the front
    if not chunks:
        return
    if isinstance(transport, ShmTransport):  # copies and verifies chunks on several threads
        yield from transport.pull_verified(lease, into, verify)
        return
    if isinstance(transport, PeerTransport):  # verifies every chunk itself: a bad one is fetched again elsewhere
        yield from transport.pull_verified(lease, into, verify=verify)
        return
    index, landed = 0, 0
    hasher = chunk_hasher(chunks[0]) if verify != "none" else None
    for offset, length in transport.pull(lease, into):
        chunk = chunks[index]
        if offset != chunk.offset + landed:
            raise FormatError(f"transport {transport.name} delivered byte {offset}, expected {chunk.offset + landed}")
        if hasher is not None:
            for view in into.views(offset, length):
                hasher.update(view)
        landed += length
        if landed == chunk.length:
            if hasher is not None:
                actual = hasher.hexdigest()
                if actual != chunk.checksum:
                    raise ChecksumMismatch(chunk.index, chunk.checksum or "", actual)
            yield chunk.offset + chunk.length
            index, landed = index + 1, 0
            if hasher is not None and index < len(chunks):
                hasher = chunk_hasher(chunks[index])
    if index != len(chunks):
        raise FormatError(f"transport {transport.name} stopped after {index} of {len(chunks)} chunks")


def _pull_windows(transport: Transport, lease: PullLease, plan: SelectionPlan, targets: list[np.ndarray],
                  verify: str, scratch_bytes: int) -> Iterator[int]:
    """A selected pull over a transport that moves whole chunks: the touched chunks, a window of
    adjacent ones at a time, land (verified) in one scratch buffer and the selected bytes are
    copied out of it. Yields the end of the data section verified and copied so far."""
    limit = max(scratch_bytes, lease.manifest.chunk_bytes)
    windows = plan.windows(limit)
    if not windows:
        return
    scratch = np.empty(max(sum(step.chunk.length for step in window) for window in windows), np.uint8)
    for window in windows:
        start = window[0].chunk.offset
        length = sum(step.chunk.length for step in window)
        landed = 0
        for verified_end in _verified_prefixes(transport, window_lease(lease, [s.chunk for s in window]),
                                               ByteRegions.flat(scratch[:length]), verify):
            while landed < len(window) and window[landed].chunk.offset + window[landed].chunk.length - start <= verified_end:
                step = window[landed]
                copy_blocks(step.copies, scratch, start, targets)
                landed += 1
                yield step.chunk.offset + step.chunk.length


def _shaped(flat: np.ndarray, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
    dtype = numpy_dtype(spec.dtype)
    if not len(flat):
        return np.empty(shape, dtype)
    return flat.view(dtype).reshape(shape)


def _selected_target(out: Mapping[str, Any], name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> np.ndarray:
    """The flat bytes of ``out[name]``, which must have the selected shape and size."""
    if name not in out:
        raise FormatError(f"out has no buffer for the selected tensor {name!r}")
    target = out[name]
    got_shape = tuple(getattr(target, "shape", ()))
    if got_shape != shape:
        raise FormatError(f"out[{name!r}] has shape {list(got_shape)}; the selection gives {dtype} {list(shape)}")
    if type(target).__module__.startswith("torch"):
        target = _torch_bytes_target(target)
    if not isinstance(target, np.ndarray) or not target.flags.writeable or not target.flags.c_contiguous:
        raise FormatError(f"out[{name!r}] must be a writable C-contiguous numpy array or CPU torch tensor")
    if target.nbytes != nbytes:
        raise FormatError(f"out[{name!r}] holds {target.nbytes} bytes; the selection gives {nbytes} ({dtype} {list(shape)})")
    return target.reshape(-1).view(np.uint8)


def _flat_target(into: Any, total_bytes: int) -> np.ndarray:
    """``into`` as a flat byte array of exactly ``total_bytes``."""
    if type(into).__module__.startswith("torch"):
        into = _torch_bytes_target(into)
    if not isinstance(into, np.ndarray) or not into.flags.writeable or not into.flags.c_contiguous:
        raise FormatError("into must be a writable C-contiguous numpy array or CPU torch tensor")
    if into.nbytes != total_bytes:
        raise FormatError(f"into holds {into.nbytes} bytes; the version's data section has {total_bytes}")
    return into.reshape(-1).view(np.uint8)


def _byte_view_of(data: Any) -> memoryview:
    if type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous:
        return data.data  # its memoryview: a shard held as bytes (a rank's pieces of a staging buffer): once per piece per push
    if type(data).__module__.startswith("torch"):
        data = _torch_bytes(data)[2]
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _view_of(flat: np.ndarray, spec: TensorSpec) -> np.ndarray:
    dtype = numpy_dtype(spec.dtype)
    if spec.nbytes == 0:
        return np.empty(spec.shape, dtype)
    return flat[spec.offset:spec.offset + spec.nbytes].view(dtype).reshape(spec.shape)


def _writable_array(out: Mapping[str, Any], spec: TensorSpec) -> Any:
    if spec.name not in out:
        raise FormatError(f"out has no buffer for tensor {spec.name!r}")
    target = out[spec.name]
    if type(target).__module__.startswith("torch"):
        target = _torch_bytes_target(target)
    if not isinstance(target, np.ndarray) or not target.flags.writeable or not target.flags.c_contiguous:
        raise FormatError(f"out[{spec.name!r}] must be a writable C-contiguous numpy array or CPU torch tensor")
    nbytes = target.nbytes
    if nbytes != spec.nbytes:
        raise FormatError(f"out[{spec.name!r}] holds {nbytes} bytes; version has {spec.nbytes} ({spec.dtype} {list(spec.shape)})")
    return target


def _torch_bytes_target(tensor: Any) -> np.ndarray:
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise FormatError("out tensors must be contiguous CPU tensors")
    return tensor.reshape(-1).view(torch.uint8).numpy()
