"""``staleflow bench params``: Pull bandwidth of each parameter-server transport, side by side with
a plain in-memory copy of the same bytes, measured in one run.

The PS runs in its own process (as in a deployment: the instances are other processes). Two ways
to receive are measured: into buffers the caller already has (an engine loading weights into its
parameters; baseline ``np.copyto`` into the same buffers) and into a fresh allocation (baseline
``np.empty`` + ``np.copyto``). Pulls into existing buffers are measured with and without checksum
verification; pulls into a new allocation with verification (the client's default).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.progress import Progress
from rich.table import Table

from staleflow.cli.common import console, emit_results, fail

TENSOR_BYTES = 64 << 20  # a large layer of a multi-GB model
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
MODES = (("into", True, "into existing buffers"), ("into_unverified", False, "into existing buffers, unverified"),
         ("fresh", True, "into a new allocation"))
GOALS = {("shm", "into"): (0.8, None, "shm >= 80% of copy"), ("http", "into"): (None, 1.0, "http >= 1 GB/s")}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r}: use e.g. 512MB, 1GB, 4GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def make_state_dict(total_bytes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors, offset, i = {}, 0, 0
    while offset < total_bytes:
        n = min(TENSOR_BYTES, total_bytes - offset) // 4 or 1
        tensors[f"layers.{i}.weight"] = rng.integers(0, 2**32, n, dtype=np.uint32)
        offset += n * 4
        i += 1
    return tensors


def _timed(fn: Callable[[], object], repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "best_s": min(times), "runs": repeats}


def _rate(nbytes: int, timing: dict) -> dict:
    return {**timing, "gb_per_s": nbytes / timing["median_s"] / 1e9, "best_gb_per_s": nbytes / timing["best_s"] / 1e9}


def measure_copies(source: dict[str, np.ndarray], out: dict[str, np.ndarray], repeats: int) -> dict:
    """The baselines: copy the same bytes into ``out`` (touched once first, as an engine's
    parameters are) and into a new allocation."""
    nbytes = sum(a.nbytes for a in source.values())

    def copy_into() -> None:
        for name, a in source.items():
            np.copyto(out[name], a)

    def copy_fresh() -> None:
        fresh = {name: np.empty_like(a) for name, a in source.items()}
        for name, a in source.items():
            np.copyto(fresh[name], a)

    copy_into()
    return {"copy_into": _rate(nbytes, _timed(copy_into, repeats)), "copy_fresh": _rate(nbytes, _timed(copy_fresh, repeats))}


def start_params_server(state_dir: Path, transports: list[str], chunk_mb: int) -> tuple[subprocess.Popen, str]:
    from staleflow.cli.main import serve_app

    command = ([sys.executable, "-m", "staleflow.cli", "serve", "params"]
               if any(c.name == "params" for c in serve_app.registered_commands)
               else [sys.executable, "-m", "staleflow.cli.serve_params"])
    proc = subprocess.Popen([*command, "--state-dir", str(state_dir), "--port", "0", "--keep", "1",
                             "--transports", ",".join(transports), "--chunk-mb", str(chunk_mb)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "listening on" in line:
            url = line.strip().rsplit(" ", 1)[-1]
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, url
    raise RuntimeError(f"the parameter server exited with {proc.wait()} before listening")


def bench_size(total_bytes: int, transports: list[str], repeats: int, chunk_mb: int,
               workdir: Path, advance: Callable[[], None]) -> dict:
    from staleflow.transports.client import ParamsClient

    source = make_state_dict(total_bytes)
    nbytes = sum(a.nbytes for a in source.values())
    result: dict = {"bytes": nbytes, "tensors": len(source), "chunk_mb": chunk_mb,
                    "load_average_before": os.getloadavg()[0]}
    proc, url = start_params_server(workdir / f"ps-{nbytes}", transports, chunk_mb)
    try:
        with ParamsClient(url, timeout=600) as client:
            start = time.perf_counter()
            client.push(1, source)
            result["push_http"] = _rate(nbytes, {"median_s": time.perf_counter() - start,
                                                 "best_s": time.perf_counter() - start, "runs": 1})
            advance()
            out = {name: np.empty_like(a) for name, a in source.items()}
            result.update(measure_copies(source, out, repeats))
            del source  # keep the peak at ~3 copies of the model (out, shared memory, one pull)
            advance()
            for transport in transports:
                client.pull(1, transport, out=out)  # warm-up: connections, mappings
                for mode, verify, _ in MODES:
                    target = out if mode.startswith("into") else None
                    timing = _timed(lambda t=transport, o=target, v=verify: client.pull(1, t, out=o, verify=v), repeats)
                    baseline = result["copy_into" if target is not None else "copy_fresh"]
                    result[f"{transport}_{mode}"] = {**_rate(nbytes, timing),
                                                     "ratio_to_copy": baseline["median_s"] / timing["median_s"],
                                                     "best_ratio_to_copy": baseline["best_s"] / timing["best_s"]}
                advance()
    finally:
        proc.terminate()
        proc.wait(30)
    return result


def run_params_bench(sizes: list[int], transports: list[str], repeats: int = 3, chunk_mb: int = 64) -> dict:
    results: dict = {"transports": transports, "repeats": repeats, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="staleflow-bench-params-") as tmp, \
            Progress(console=console, transient=True) as progress:
        task = progress.add_task("parameter server benchmark", total=len(sizes) * (2 + len(transports)))
        for size in sizes:
            results["sizes"].append(bench_size(size, transports, repeats, chunk_mb, Path(tmp),
                                               lambda: progress.advance(task)))
    return results


def available_transports() -> list[str]:
    from staleflow.transports.nixl import nixl_available

    return ["http", "shm"] + (["nixl"] if nixl_available()[0] else [])


def _print(results: dict) -> None:
    for size in results["sizes"]:
        table = Table(title=f"Pull of a {size['bytes'] / 1e9:.2f} GB state dict ({size['tensors']} tensors, "
                            f"{size['chunk_mb']} MiB chunks; load average {size['load_average_before']:.1f})")
        for column, justify in (("path", "left"), ("GB/s median", "right"), ("GB/s best", "right"),
                                ("vs copy (median)", "right"), ("vs copy (best)", "right"), ("goal (median)", "left")):
            table.add_column(column, justify=justify)
        for baseline, label in (("into", "into existing buffers"), ("fresh", "into a new allocation")):
            copy = size[f"copy_{baseline}"]
            table.add_row(f"in-memory copy, {label}", f"{copy['gb_per_s']:.2f}", f"{copy['best_gb_per_s']:.2f}",
                          "1.00", "1.00", "")
            for mode, _, mode_label in MODES:
                if not mode.startswith(baseline):
                    continue
                for transport in results["transports"]:
                    row = size[f"{transport}_{mode}"]
                    table.add_row(f"  {transport} pull, {mode_label}", f"{row['gb_per_s']:.2f}",
                                  f"{row['best_gb_per_s']:.2f}", f"{row['ratio_to_copy']:.2f}",
                                  f"{row['best_ratio_to_copy']:.2f}", _goal(transport, mode, row))
        push = size["push_http"]
        table.add_row("http push (one run, incl. fsync and commit)", f"{push['gb_per_s']:.2f}", "", "", "", "")
        console.print(table)


def _goal(transport: str, mode: str, row: dict) -> str:
    goal = GOALS.get((transport, mode))
    if goal is None:
        return ""
    min_ratio, min_rate, text = goal
    met = row["ratio_to_copy"] >= min_ratio if min_ratio is not None else row["gb_per_s"] >= min_rate
    return f"{text}: {'[green]met[/]' if met else '[red]missed[/]'}"


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("params")
    def params_cmd(
        sizes: Annotated[str, typer.Option(help="state-dict sizes, comma-separated")] = "1GB,4GB",
        transports: Annotated[str | None, typer.Option(help="comma-separated; default: all available here")] = None,
        repeats: Annotated[int, typer.Option(help="pulls per measurement (median reported)")] = 3,
        chunk_mb: Annotated[int, typer.Option("--chunk-mb", help="PS chunk size in MiB")] = 64,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        output: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
    ) -> None:
        """Pull GB/s per transport (http, shm, nixl) vs an in-memory copy, for each state-dict size."""
        try:
            size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
        except ValueError as exc:
            raise fail(str(exc)) from None
        chosen = [t.strip() for t in transports.split(",")] if transports else available_transports()
        if "http" not in chosen:
            chosen.insert(0, "http")  # pushes go over http
        if max(size_list) * 4.2 > _available_memory():
            raise fail(f"{max(size_list) / 1e9:.1f} GB needs ~{max(size_list) * 4.2 / 1e9:.0f} GB of memory "
                       f"(source, destination, shared memory, one pull); {_available_memory() / 1e9:.0f} GB available",
                       "pass smaller --sizes")
        results = run_params_bench(size_list, chosen, repeats, chunk_mb)
        emit_results(results, output, as_json, _print)


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


if __name__ == "__main__":
    standalone = typer.Typer(add_completion=False)
    register(standalone)
    standalone(prog_name="staleflow bench params")
