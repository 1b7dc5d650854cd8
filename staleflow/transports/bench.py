"""The parameter server benchmark (``staleflow bench params``, ``run_params_bench``): weight sync
as the paper measures it (Figure 19), next to a plain in-memory copy of the same bytes, in one run.

For each state-dict size, ``N`` trainer-rank processes each hold their dim-0 shard of every
tensor (as FSDP ranks do) and push it at once, over shared memory, HTTP or NIXL, to a parameter server
in its own process; ``K`` instance processes wait for the version and pull it, verified as each of
the ``verify`` modes says (``auto``: checksums, over shm the slot's generation stamp; ``checksum``:
every byte hashed), into buffers they already hold (an engine's parameters), and report the pull's
CPU time next to memcpy's. Per version it records: push time (until the
last rank's bytes are in), time until visible, each instance's pull time (all ``K`` at once), the
end-to-end version latency (trainer done -> every instance loaded), each rank's peak extra memory during its
push, and the persist time (the copy to disk, after the version is visible and outside the timed
path). The baseline is ``np.copyto`` of the same bytes into an existing buffer.

Each version is deleted after it is measured, so the next one takes its memory slot: the PS
holds one version at a time. A size whose shards, slot and instance copies do not fit in this
host's memory runs *pooled*: the ranks' shards and the instances' parameters of same-shaped
tensors share a ring of buffers (an instance's real parameters live in device memory; equal
shapes hold equal bytes here, so sharing changes no byte and no checksum), the PS holds every
byte of the version, and the memcpy baseline copies tensor by tensor between two such rings.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.host import meminfo_bytes, status_kib
from staleflow.transports.tables import table_bytes

TENSOR_BYTES = 64 << 20  # a large layer of a multi-GB model
RING_TENSORS = 8  # buffers behind a pooled state dict: 512 MiB, 16x this host's L3, so no copy is served from cache
TARGETS = {"push_visible_shm": 0.8, "http_stream_gb_per_s": 1.0, "pull_shm": 0.8, "end_to_end": 1.5}


def tensor_table(total_bytes: int, tensor_bytes: int = TENSOR_BYTES) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Synthetic state dict: U32 tensors of ``tensor_bytes`` (the last one smaller), 1024 rows each."""
    table, offset, i = {}, 0, 0
    while offset < total_bytes:
        n = max(1024, (min(tensor_bytes, total_bytes - offset) // 4096) * 1024)
        table[f"layers.{i}.weight"] = ("U32", (1024, n // 1024))
        offset += n * 4
        i += 1
    return table


def rank_pieces(table: dict[str, tuple[str, tuple[int, ...]]], rank: int, ranks: int, pooled: bool = False) -> list:
    """Rank ``rank``'s dim-0 shard of every tensor (FSDP2's split), filled with its own bytes.
    ``pooled``: the shards of same-sized tensors share ``RING_TENSORS`` buffers (a state dict
    larger than this host's memory; equal shapes hold equal bytes, so sharing changes nothing)."""
    from staleflow.transports.client import ShardPiece
    from staleflow.transports.tables import fsdp_shard_ranges

    pieces, buffers = [], {}
    for i, (name, start, nbytes) in enumerate(fsdp_shard_ranges(table, rank, ranks)):
        key = (nbytes, i % RING_TENSORS if pooled else i)
        if key not in buffers:
            buffers[key] = aligned_array(nbytes, np.uint8, (rank * 7919 + 1) % 251)
        pieces.append(ShardPiece(name, start, buffers[key]))
    return pieces


TORCH_ALIGNMENT = 64


def aligned_array(shape: int | tuple[int, ...], dtype: Any, fill: int) -> np.ndarray:
    """A filled (so touched) array starting on a ``TORCH_ALIGNMENT`` boundary, where torch's CPU
    allocator puts a trainer's and an engine's tensors (numpy's large arrays start 16 bytes past a
    page). The alignment decides how glibc copies them out of and into the PS's slot."""
    dtype = np.dtype(dtype)
    count = math.prod(shape) if isinstance(shape, tuple) else shape
    raw = np.empty(count * dtype.itemsize + TORCH_ALIGNMENT, np.uint8)
    start = (-raw.__array_interface__["data"][0]) % TORCH_ALIGNMENT
    array = raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)
    array.fill(fill)
    return array


_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def engine_buffers(table: dict[str, tuple[str, tuple[int, ...]]], pooled: bool = False) -> dict[str, np.ndarray]:
    """An instance's parameters to pull into (touched, as an engine's are); ``pooled``: same-shaped
    tensors share ``RING_TENSORS`` buffers, standing in for device memory the host does not have
    (every full-size tensor of a version holds the same bytes, so sharing changes nothing)."""
    from staleflow.transports.dtypes import DTYPE_SIZES

    buffers: dict[tuple, np.ndarray] = {}
    out = {}
    for i, (name, (dtype, shape)) in enumerate(table.items()):
        key = (dtype, shape, i % RING_TENSORS if pooled else i)
        if key not in buffers:
            buffers[key] = aligned_array(shape, _UINT_OF_WIDTH[DTYPE_SIZES[dtype]], 1)
        out[name] = buffers[key]
    return out


def rss_anon() -> int:
    """This process's private resident memory (shared-memory mappings excluded)."""
    return (status_kib("RssAnon") or 0) * 1024


class PeakMemory:
    """Samples ``rss_anon`` on a thread while a push runs: the push's extra memory."""

    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        self.base = rss_anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # sampling period, not synchronization
            self.peak = max(self.peak, rss_anon())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _device_tensors(sizes: list[int], device: str, fill: int) -> list:
    import torch

    return [torch.full((n,), fill, dtype=torch.uint8, device=device) for n in sizes]


def commands(conn: Connection) -> Iterator[Any]:
    """What a worker process is told over its pipe, until it is told None (stop)."""
    while (message := conn.recv()) is not None:
        yield message


def _rank_main(conn: Connection, url: str, table: dict, rank: int, ranks: int, pooled: bool, device: str) -> None:
    """A trainer rank: holds its shards (host arrays, or tensors on ``device``); on ("push",
    version, transport, t0) pushes them (from ``device``: copied into one pinned host buffer first)."""
    from staleflow.transports.client import ParamsClient, ShardPiece

    staging = None
    if device == "host":
        pieces = rank_pieces(table, rank, ranks, pooled)
    else:
        from staleflow.transports.staging import FlatStaging
        from staleflow.transports.tables import fsdp_shard_ranges

        ranges = fsdp_shard_ranges(table, rank, ranks)
        staging = FlatStaging(_device_tensors([n for _, _, n in ranges], device, (rank * 7919 + 1) % 251))
        host = staging.host_array()
        pieces = [ShardPiece(name, start, host[offset:offset + n])
                  for (name, start, n), offset in zip(ranges, staging.offsets, strict=True)]
    shard_bytes = sum(p.nbytes for p in pieces)
    with ParamsClient(url, timeout=600) as client:
        conn.send({"ready": True, "shard_bytes": shard_bytes})
        for _, version, transport, wait_s in commands(conn):
            with PeakMemory() as memory:
                started = time.monotonic()
                if staging is not None:
                    staging.to_host()
                staged, cpu = time.monotonic(), time.process_time()
                reply = client.push_part(version, rank, ranks, table, pieces, transport=transport, wait_s=0)
                delivered = reply["delivered_at_monotonic"]  # its bytes are in (the finish call follows)
                cpu = time.process_time() - cpu  # the copy threads' too
                if not reply["visible"]:  # wait for the other ranks' parts
                    client.close_pull(client.open_pull(version, "http", wait_s=wait_s))
                    reply = {"visible": True}
                returned = time.monotonic()
            conn.send({"started": started, "staged": staged, "delivered": delivered, "returned": returned, "push_cpu_s": cpu,
                       "visible": reply["visible"], "extra_bytes": memory.extra, "shard_bytes": shard_bytes})


def _instance_main(conn: Connection, url: str, table: dict, pooled: bool, device: str) -> None:
    """An instance: holds parameters of the model's size (host arrays, or tensors on ``device``
    behind one pinned host buffer); on ("pull", version, transport) waits for the version and
    pulls it into them, verified as ``verify`` says (from ``device``: into the pinned buffer, then
    host to device); the pull's CPU time is the process's (the copy threads' too)."""
    from staleflow.transports.client import ParamsClient
    from staleflow.transports.dtypes import DTYPE_SIZES

    staging = out = None
    if device == "host":
        out = engine_buffers(table, pooled)
    else:
        from staleflow.transports.staging import FlatStaging

        sizes = [math.prod(shape) * DTYPE_SIZES[dtype] for dtype, shape in table.values()]
        staging = FlatStaging(_device_tensors(sizes, device, 1))
    with ParamsClient(url, timeout=600) as client:
        conn.send({"ready": True})
        for _, version, transport, wait_s, verify in commands(conn):
            lease = client.open_pull(version, transport, wait_s=wait_s)
            leased, cpu = time.monotonic(), time.process_time()
            try:
                for _ in client.receive(lease, out=out, into=None if staging is None else staging.host, verify=verify):
                    pass
            finally:
                client.close_pull(lease)
            pulled, cpu = time.monotonic(), time.process_time() - cpu
            if staging is not None:
                staging.to_device()
            conn.send({"leased": leased, "pulled": pulled, "loaded": time.monotonic(), "pull_cpu_s": cpu})


class Workers:
    """Processes of one kind, driven over pipes."""

    def __init__(self, target: Callable[..., None], args_of: Callable[[int], tuple], count: int):
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=target, args=(child, *args_of(i)), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.hello = [self._recv(c, p) for c, p in zip(self.conns, self.procs, strict=True)]

    @staticmethod
    def _recv(conn: Connection, proc: Any) -> dict:
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"benchmark worker {proc.name} exited with {proc.exitcode}")
        return conn.recv()

    def send(self, message: Any, count: int | None = None) -> None:
        for conn in self.conns[:count]:
            conn.send(message)

    def gather(self, count: int | None = None) -> list[dict]:
        return [self._recv(c, p) for c, p in list(zip(self.conns, self.procs, strict=True))[:count]]

    def answer(self, index: int) -> dict:
        """Worker ``index``'s next answer."""
        return self._recv(self.conns[index], self.procs[index])

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def measure_memcpy(table: dict, repeats: int, pooled: bool = False) -> dict:
    """``np.copyto`` of the table's bytes into an existing buffer; ``pooled``: tensor by tensor
    between two rings of ``RING_TENSORS`` buffers (the bytes do not fit in memory twice)."""
    total_bytes = table_bytes(table)
    if pooled:
        sources, targets = engine_buffers(table, pooled=True), engine_buffers(table, pooled=True)
        pairs = [(targets[name], sources[name]) for name in table]
    else:
        source = np.full(total_bytes, 3, np.uint8)
        pairs = [(np.ones_like(source), source)]
    times, cpu = [], []
    for _ in range(repeats + 1):
        start, started_cpu = time.perf_counter(), time.thread_time()
        for target, source in pairs:
            np.copyto(target, source)
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - started_cpu)
    times, cpu = times[1:], cpu[1:]
    return {"median_s": statistics.median(times), "best_s": min(times), "cpu_s": statistics.median(cpu),
            "gb_per_s": total_bytes / statistics.median(times) / 1e9, "pooled": pooled}


def measure_copy_bound(total_bytes: int, repeats: int, device: str) -> dict:
    """The copy bound of trainer device -> engine device through host memory, in this run:
    one pinned device-to-host copy, one host memcpy and one pinned host-to-device copy of
    ``total_bytes``."""
    import torch

    cuda = torch.device(device).type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    source = torch.full((total_bytes,), 5, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    staged = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=cuda)
    landed = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=cuda)
    legs: dict[str, list[float]] = {"d2h_s": [], "memcpy_s": [], "h2d_s": []}
    for i in range(repeats + 1):
        synchronize()
        t0 = time.perf_counter()
        staged.copy_(source, non_blocking=cuda)
        synchronize()
        t1 = time.perf_counter()
        np.copyto(landed.numpy(), staged.numpy())
        t2 = time.perf_counter()
        target.copy_(landed, non_blocking=cuda)
        synchronize()
        t3 = time.perf_counter()
        if i:
            legs["d2h_s"].append(t1 - t0)
            legs["memcpy_s"].append(t2 - t1)
            legs["h2d_s"].append(t3 - t2)
    bound = {leg: statistics.median(times) for leg, times in legs.items()}
    bound["copy_bound_s"] = sum(bound.values())
    bound["d2h_gb_per_s"] = total_bytes / bound["d2h_s"] / 1e9
    bound["h2d_gb_per_s"] = total_bytes / bound["h2d_s"] / 1e9
    return bound


def start_params_server(state_dir: Path, transports: list[str], chunk_mb: int, persist: bool,
                        egress_gbps: float | None = None, extra: Sequence[str] = (),
                        keep: int = 1) -> tuple[subprocess.Popen, str]:
    """A PS in its own process, as an operator starts one (``staleflow serve params``);
    ``egress_gbps``: its egress limit (a link of that speed), None for none; ``extra``: more
    options (a holder's ``--holder-of``, ...); ``keep``: the versions it keeps (and, with
    holders, keeps available)."""
    # -P as this process was started: a checkout's folders must not shadow the installed package
    safe_path = ["-P"] if sys.flags.safe_path else []
    egress = [] if egress_gbps is None else ["--egress-gbps", str(egress_gbps)]
    proc = subprocess.Popen([sys.executable, *safe_path, "-m", "staleflow.cli", "serve", "params", "--state-dir", str(state_dir),
                             "--port", "0", "--keep", str(keep), "--no-fsync", "--persist" if persist else "--no-persist",
                             "--transports", ",".join(transports), "--chunk-mb", str(chunk_mb), *egress, *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    stderr = proc.stderr
    assert stderr is not None  # stderr=PIPE
    for line in stderr:
        if "listening on" in line:
            url = line.strip().rsplit(" ", 1)[-1]
            threading.Thread(target=stderr.read, daemon=True).start()
            return proc, url
        said = [*said[-19:], line]
    raise RuntimeError(f"the parameter server exited with {proc.wait()} before listening; it said:\n{''.join(said)}")


def memory_need(total_bytes: int, ranks: int, instances: int, pooled: bool, largest_tensor: int = TENSOR_BYTES) -> int:
    """Bytes a cell holds at once: the PS's one memory slot (each version is deleted after it is
    measured, so the next reuses the slot), the ranks' shards and the instances' parameters
    (whole, or ``RING_TENSORS`` buffers each when pooled)."""
    ring = min(total_bytes, RING_TENSORS * largest_tensor)
    if pooled:
        return total_bytes + ring * (ranks + instances)
    return total_bytes * (2 + instances)


def choose_pooling(total_bytes: int, rank_counts: list[int], instance_counts: list[int], pool: str) -> bool:
    """``auto``: pooled only when some cell would not fit in memory unpooled."""
    if pool != "auto":
        return pool == "on"
    return not fits(total_bytes, max(rank_counts), max(instance_counts), False)[0]


def fits(total_bytes: int, ranks: int, instances: int, pooled: bool) -> tuple[bool, str]:
    need = memory_need(total_bytes, ranks, instances, pooled)
    available = available_memory()
    if need * 1.15 > available:  # 15 % headroom
        what = "pooled shards and parameters" if pooled else "shards, parameters"
        return False, f"needs ~{need / 1e9:.0f} GB (1 slot, {what} of {ranks} rank(s) and {instances} instance(s)); " \
                      f"{available / 1e9:.0f} GB available"
    return True, ""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_cell(ranks: Workers, instances: Workers, client: Any, n_ranks: int, k: int, transport: str,
               total_bytes: int, repeats: int, next_version: Callable[[], int], memcpy: dict, warmup: int = 1,
               persist: bool = True, device: str = "host", verify: str = "auto") -> dict:
    """``warmup`` unmeasured versions first: they map the shared-memory slots in every process
    (a fresh mapping costs a page fault per 4 KiB, several times the copy) and open connections."""
    memcpy_s = memcpy["median_s"]
    rows = []
    for i in range(repeats + warmup):
        version = next_version()
        instances.send(("pull", version, transport, 600.0, verify), k)
        t0 = time.monotonic()  # "trainer done": the ranks start pushing
        ranks.send(("push", version, transport, 600.0), n_ranks)
        pushed = ranks.gather(n_ranks)
        loaded = instances.gather(k)
        if not all(p["visible"] for p in pushed):
            raise RuntimeError(f"version {version} did not become visible: {pushed}")
        if persist:
            client.wait_persisted(version, 600)  # outside the timed path, so the next push runs alone
        summary = next(v for v in client.versions().versions if v.version == version)
        client.delete_version(version)  # its memory slot takes the next version
        if i < warmup:
            continue
        visible = summary.visible_at_monotonic - t0  # the PS's own clock reading (same host)
        rows.append({
            "push_s": max(p["delivered"] for p in pushed) - t0,
            "visible_s": visible,
            "pull_s": [x["loaded"] - x["leased"] for x in loaded],
            "pull_cpu_s": [x["pull_cpu_s"] for x in loaded],
            "push_cpu_s": max(p["push_cpu_s"] for p in pushed),
            "end_to_end_s": max(x["loaded"] for x in loaded) - t0,
            "lease_after_visible_s": max(x["leased"] for x in loaded) - (t0 + visible),
            "rank_extra_bytes": max(p["extra_bytes"] for p in pushed),
            "persist_s": summary.persist_seconds,
            "d2h_s": max(p["staged"] - p["started"] for p in pushed),
            "push_to_visible_s": visible - max(p["staged"] - t0 for p in pushed),
            "h2d_s": max(x["loaded"] - x["pulled"] for x in loaded),
        })
    cell = {
        "transport": transport, "verify": verify, "ranks": n_ranks, "instances": k, "runs": repeats,
        "push_s": _median([r["push_s"] for r in rows]),
        "visible_s": _median([r["visible_s"] for r in rows]),
        "pull_s": _median([s for r in rows for s in r["pull_s"]]),
        "pull_cpu_s": _median([s for r in rows for s in r["pull_cpu_s"]]),
        "push_cpu_s": _median([r["push_cpu_s"] for r in rows]),
        "end_to_end_s": _median([r["end_to_end_s"] for r in rows]),
        "lease_after_visible_s": _median([r["lease_after_visible_s"] for r in rows]),
        "rank_extra_bytes": max(r["rank_extra_bytes"] for r in rows),
        "persist_s": _median([r["persist_s"] for r in rows if r["persist_s"] is not None]) if persist else None,
    }
    if device != "host":  # the legs of trainer device -> engine device
        for leg in ("d2h_s", "push_to_visible_s", "h2d_s"):
            cell[leg] = _median([r[leg] for r in rows])
    cell["push_gb_per_s"] = total_bytes / cell["visible_s"] / 1e9
    cell["push_gb_per_s_per_stream"] = cell["push_gb_per_s"] / n_ranks
    cell["visible_vs_memcpy"] = memcpy_s / cell["visible_s"]
    cell["pull_gb_per_s"] = total_bytes / cell["pull_s"] / 1e9
    cell["pull_vs_memcpy"] = memcpy_s / cell["pull_s"]
    cell["pull_cpu_vs_memcpy"] = memcpy["cpu_s"] / cell["pull_cpu_s"] if cell["pull_cpu_s"] else float("nan")
    cell["push_cpu_vs_memcpy"] = memcpy["cpu_s"] / cell["push_cpu_s"] if cell["push_cpu_s"] else float("nan")
    return cell


def bench_table(label: str, table: dict, transports: list[str], rank_counts: list[int], instance_counts: list[int],
                repeats: int, chunk_mb: int, workdir: Path, advance: Callable[[], None], pool: str = "auto",
                device: str = "host", verify_modes: Sequence[str] = ("auto",), persist: bool = True,
                link_gbps: float | None = None) -> dict:
    """Every cell (transport x verify mode x ranks x instances) for one tensor table. ``persist``:
    the PS persists each version (its copy to disk runs while the instances pull); ``link_gbps``:
    the PS's egress limit (its http chunk bodies), None for none."""
    from staleflow.transports.client import ParamsClient

    total_bytes = table_bytes(table)
    pooled = device == "host" and choose_pooling(total_bytes, rank_counts, instance_counts, pool)
    # persisting a version that does not fit in memory twice would measure the disk, not the sync
    persist = persist and not pooled
    result: dict = {"table": label, "bytes": total_bytes, "tensors": len(table), "chunk_mb": chunk_mb, "pooled": pooled,
                    "device": device, "persist": persist, "load_average_before": os.getloadavg()[0], "cells": [], "skipped": []}
    result["memcpy"] = measure_memcpy(table, repeats, pooled)
    memcpy_s = result["memcpy"]["median_s"]
    result["verify"] = list(verify_modes)
    if device != "host":
        result["copy_bound"] = measure_copy_bound(total_bytes, repeats, device)
    counter = iter(range(1, 1 << 30))
    # decided before the PS's slot exists (the slot is counted in the need)
    verdicts = {(n, k): fits(total_bytes, n, k, pooled) for n in rank_counts for k in instance_counts}
    result["skipped"] = [{"ranks": n, "instances": k, "why": why} for (n, k), (ok, why) in verdicts.items() if not ok]
    proc, url = start_params_server(workdir / f"ps-{abs(hash(label))}", sorted({"http", *transports}), chunk_mb, persist,
                                    link_gbps)
    try:
        with ParamsClient(url, timeout=600) as client:
            for n_ranks in rank_counts:
                runnable = [k for k in instance_counts if verdicts[n_ranks, k][0]]
                if not runnable:
                    advance()
                    continue
                ranks = Workers(_rank_main, lambda r, n=n_ranks: (url, table, r, n, pooled, device), n_ranks)
                instances = Workers(_instance_main, lambda _: (url, table, pooled, device), max(runnable))
                try:
                    result["shard_bytes"] = result.get("shard_bytes", {}) | {str(n_ranks): max(h["shard_bytes"] for h in ranks.hello)}
                    warmup = 1  # maps the slot in the new processes
                    for transport in transports:
                        for verify in verify_modes:
                            for k in runnable:
                                result["cells"].append(bench_cell(ranks, instances, client, n_ranks, k, transport, total_bytes,
                                                                  repeats, lambda: next(counter), result["memcpy"], warmup,
                                                                  persist, device, verify))
                finally:
                    ranks.close()
                    instances.close()
                advance()
    finally:
        proc.terminate()
        proc.wait(60)
    one_pull = {(c["transport"], c["verify"]): c["pull_s"] for c in result["cells"]
                if c["instances"] == 1 and c["ranks"] == rank_counts[0]}
    for cell in result["cells"]:
        pull_s = one_pull.get((cell["transport"], cell["verify"]), float("nan"))
        cell["end_to_end_vs_copy_plus_pull"] = cell["end_to_end_s"] / (memcpy_s + pull_s)
        if "copy_bound" in result:
            cell["end_to_end_vs_copy_bound"] = cell["end_to_end_s"] / result["copy_bound"]["copy_bound_s"]
    result["load_average_after"] = os.getloadavg()[0]
    return result


def compare_with_synthetic(results: dict) -> None:
    """Each real table's rates against the synthetic table of its bytes (to 4 KiB) measured in the same
    run (``vs_synthetic``: the real table's GB/s over the synthetic one's, per cell)."""
    twins = {size["twin_of"]: size for size in results["sizes"] if size.get("twin_of")}
    for size in results["sizes"]:
        twin = twins.get(size.get("table"))
        if size.get("table") == "synthetic" or twin is None:
            continue
        cells = {(c["transport"], c["verify"], c["ranks"], c["instances"]): c for c in twin["cells"]}
        for cell in size["cells"]:
            other = cells.get((cell["transport"], cell["verify"], cell["ranks"], cell["instances"]))
            if other is not None:
                cell["vs_synthetic"] = {"push": cell["push_gb_per_s"] / other["push_gb_per_s"],
                                        "pull": cell["pull_gb_per_s"] / other["pull_gb_per_s"]}


def _ignore(_: int) -> None:
    pass


def pull_side_by_side(label: str, table: dict, verify_modes: Sequence[str], rounds: int, chunk_mb: int,
                      workdir: Path) -> dict:
    """memcpy of the table's bytes and one shm pull per verify mode, interleaved in this process
    (each round in a rotated order, after one unmeasured round), against a PS in its own process
    holding one version of the table: what each pull costs next to memcpy under the same load.
    Wall and CPU time per round (the pull's CPU time is this process's: the copy threads'; memcpy's
    its one thread's)."""
    from staleflow.transports.client import ParamsClient, ShardPiece

    total_bytes = table_bytes(table)
    source = aligned_array(total_bytes, np.uint8, 3)
    memcpy_target = aligned_array(total_bytes, np.uint8, 1)
    out = engine_buffers(table)
    proc, url = start_params_server(workdir / f"side-{abs(hash(label))}", ["http", "shm"], chunk_mb, persist=False)
    try:
        with ParamsClient(url, timeout=600) as client:
            pieces = [ShardPiece(name, 0, view) for name, view in zip(table, _split(source, table), strict=True)]
            client.push_part(1, 0, 1, table, pieces, transport="shm", wait_s=600)

            def pull(verify: str) -> None:
                lease = client.open_pull(1, "shm")
                try:
                    for _ in client.receive(lease, out=out, verify=verify):
                        pass
                finally:
                    client.close_pull(lease)

            runs: dict[str, Callable[[], None]] = {"memcpy": lambda: np.copyto(memcpy_target, source)}
            runs |= {f"pull {mode}": lambda mode=mode: pull(mode) for mode in verify_modes}
            names = list(runs)
            wall: dict[str, list[float]] = {name: [] for name in names}
            cpu: dict[str, list[float]] = {name: [] for name in names}
            load_before = os.getloadavg()[0]
            for round_ in range(rounds + 1):
                for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                    clock = time.thread_time if name == "memcpy" else time.process_time
                    started, started_cpu = time.perf_counter(), clock()
                    runs[name]()
                    if round_:
                        wall[name].append(time.perf_counter() - started)
                        cpu[name].append(clock() - started_cpu)
    finally:
        proc.terminate()
        proc.wait(60)
    rows = {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in names}
    for row in rows.values():
        row["vs_memcpy"] = rows["memcpy"]["wall_s"] / row["wall_s"]
        row["cpu_vs_memcpy"] = rows["memcpy"]["cpu_s"] / row["cpu_s"]
        row["gb_per_s"] = total_bytes / row["wall_s"] / 1e9
    return {"table": label, "bytes": total_bytes, "tensors": len(table), "rounds": rounds, "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0], "runs": rows, "wall_s": wall, "cpu_s": cpu}


def _split(flat: np.ndarray, table: dict) -> list[np.ndarray]:
    """``flat`` cut into the table's tensors' bytes, in order."""
    from staleflow.transports.dtypes import DTYPE_SIZES

    views, at = [], 0
    for dtype, shape in table.values():
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        views.append(flat[at:at + n])
        at += n
    return views


def run_params_bench(sizes: list[int], transports: list[str], rank_counts: list[int], instance_counts: list[int],
                     repeats: int = 3, chunk_mb: int = 64, pool: str = "auto", models: Sequence[tuple[str, dict]] = (),
                     synthetic_twins: bool = True, device: str = "host", planned: Callable[[int], None] = _ignore,
                     advance: Callable[[int], None] = _ignore, verify_modes: Sequence[str] = ("auto",),
                     side_by_side: bool = False, persist: bool = True, link_gbps: float | None = None) -> dict:
    """``sizes``: synthetic tables; ``models``: (label, tensor table) of real architectures, each
    beside a synthetic table of its bytes when ``synthetic_twins``. Progress: ``planned(steps)``
    once, then ``advance(steps)`` as they are done. ``side_by_side``: instead of the cells, each
    table's ``pull_side_by_side`` (``repeats`` rounds), under ``side_by_side`` in the result."""
    results: dict = {"transports": transports, "verify": list(verify_modes), "ranks": rank_counts, "instances": instance_counts,
                     "repeats": repeats, "link_gbps": link_gbps,
                     "cpus": os.cpu_count(), "memory_bytes": total_memory(), "targets": TARGETS, "device": device, "sizes": []}
    work: list[tuple[str, dict, str | None]] = [("synthetic", tensor_table(size), None) for size in sizes]
    for label, table in models:
        work.append((label, table, None))
        if synthetic_twins:
            work.append(("synthetic", tensor_table(table_bytes(table)), label))
    planned(len(work) * (1 if side_by_side else len(rank_counts)))
    with tempfile.TemporaryDirectory(prefix="staleflow-bench-params-") as tmp:
        if side_by_side:
            results["side_by_side"] = []
            for label, table, _ in work:
                results["side_by_side"].append(pull_side_by_side(label, table, verify_modes, repeats, chunk_mb, Path(tmp)))
                advance(1)
            return results
        for label, table, twin_of in work:
            size = table_bytes(table)
            pooled = device == "host" and choose_pooling(size, rank_counts, instance_counts, pool)
            smallest = fits(size, min(rank_counts), min(instance_counts), pooled)
            if not smallest[0]:
                results["sizes"].append({"table": label, "bytes": size, "tensors": len(table), "cells": [],
                                         "skipped": [{"why": smallest[1]}]})
                advance(len(rank_counts))
                continue
            results["sizes"].append(bench_table(label, table, transports, rank_counts, instance_counts, repeats, chunk_mb,
                                                Path(tmp), lambda: advance(1), pool, device, verify_modes, persist,
                                                link_gbps)
                                    | ({"twin_of": twin_of} if twin_of else {}))
    compare_with_synthetic(results)
    return results


def _meminfo(key: str) -> int:
    found = meminfo_bytes(key)
    return 1 << 62 if found is None else found


def available_memory() -> int:
    return _meminfo("MemAvailable")


def total_memory() -> int:
    return _meminfo("MemTotal")


