"""The ledger benchmark (``staleflow bench ledger``, ``run_ledger_bench``): pure-ledger transitions/s,
durable transitions/s through SQLite or PostgreSQL, and HTTP reserve/occupy latency, side by side in one run.
Each part also reports the process's CPU time (all threads) per transition or request: on a loaded
machine wall-clock rates move with the load, CPU time much less."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from staleflow.config import LedgerConfig, ManagerConfig
from staleflow.config.manager import LedgerParams
from staleflow.ledger import Ledger

LEDGER_BENCH_PARTS = 5


def _fill_and_drain(ledger, params: LedgerParams, prefix: str, workers: int = 1) -> int:
    """One training step in steady state: reserve what is admissible at the newest version,
    occupy it, consume one buffer. Returns the number of transitions."""
    t = ledger.train_version
    n_new = ledger.admission([t])[t]
    ids = [f"{prefix}-{t}-{i}" for i in range(n_new)]

    def lifecycle(chunk: list[str]) -> None:
        for g in chunk:
            ledger.reserve(g, t)
        for g in chunk:
            ledger.occupy(g)

    if workers == 1:
        lifecycle(ids)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lifecycle, [ids[i::workers] for i in range(workers)]))
    ledger.consume()
    return 2 * n_new + 1


def bench_pure(params: LedgerParams, steps: int) -> dict:
    ledger = Ledger(params)
    ops, start, cpu = 0, time.perf_counter(), time.process_time()
    for _ in range(steps):
        ops += _fill_and_drain(ledger, params, "p")
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"transitions": ops, "seconds": elapsed, "per_second": ops / elapsed, "cpu_us_per_transition": 1e6 * cpu / ops}


def _empty_database(db_url: str | None, workdir: Path, name: str) -> str:
    """A SQLite file in ``workdir``, or the given database with StaleFlow's tables dropped."""
    if db_url is None:
        return f"sqlite:///{workdir / name}"
    from staleflow.servers import db

    engine = db.make_engine(db_url)
    try:
        db.downgrade(engine, "base")
    finally:
        engine.dispose()
    return db_url


def bench_durable(params: LedgerParams, steps: int, workers: int, synchronous: str, workdir: Path,
                  db_url: str | None = None) -> dict:
    from staleflow.servers.manager.store import DurableLedger

    url = _empty_database(db_url, workdir, f"durable-{workers}-{synchronous}.db")
    ledger = DurableLedger.open(url, params, synchronous)
    try:
        ops, start, cpu = 0, time.perf_counter(), time.process_time()
        for _ in range(steps):
            ops += _fill_and_drain(ledger, params, f"d{workers}", workers)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        ledger.close()
    return {"transitions": ops, "seconds": elapsed, "per_second": ops / elapsed, "workers": workers,
            "synchronous": synchronous, "cpu_us_per_transition": 1e6 * cpu / ops}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_http(params: LedgerParams, requests: int, workdir: Path, db_url: str | None = None) -> dict:
    from staleflow.api.manager import ManagerClient
    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.manager import create_app

    config = ManagerConfig(
        ledger=LedgerConfig(eta=params.eta, batch_size=params.batch_size, group_size=params.group_size),
        db_url=_empty_database(db_url, workdir, "http.db"),
    )
    latencies: dict[str, list[float]] = {"reserve": [], "occupy": []}
    with serve_in_thread(create_app(config)) as server, ManagerClient(server.url) as client:
        client.health()  # waits for the lifespan (database open) to finish
        done, cpu = 0, time.process_time()
        while done < requests:
            t = client.buffers().train_version
            room = client.admission([t]).by_version()[t]
            ids = [f"h-{t}-{i}" for i in range(min(room, requests - done))]
            for g in ids:
                start = time.perf_counter()
                client.reserve(g, t)
                latencies["reserve"].append(time.perf_counter() - start)
            for g in ids:
                start = time.perf_counter()
                client.occupy(g)
                latencies["occupy"].append(time.perf_counter() - start)
            done += len(ids)
            if len(ids) == room:
                client.consume()
        cpu = time.process_time() - cpu
    results: dict = {
        op: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * _percentile(v, 0.99), "n": len(v)}
        for op, v in latencies.items()
    }
    # client and server together, the loop's few buffers / admission / consume calls included
    results["cpu_us_per_request"] = 1e6 * cpu / sum(len(v) for v in latencies.values())
    return results


def run_ledger_bench(eta: int, batch_size: int, steps: int, http_requests: int, workers: int,
                     db_url: str | None = None, advance: Callable[[], None] = lambda: None) -> dict:
    """``db_url``: run the durable and HTTP parts on this database (its StaleFlow tables are dropped
    before each part) instead of temporary SQLite files. ``advance`` is called after each of the
    ``LEDGER_BENCH_PARTS`` parts."""
    params = LedgerParams(eta=eta, batch_size=batch_size)
    database = "sqlite (temporary files)"
    if db_url is not None:
        from staleflow.servers.db import masked

        database = masked(db_url)
    results: dict = {"params": {"eta": eta, "batch_size": batch_size, "steps": steps, "database": database}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results["pure"] = bench_pure(params, steps)
        advance()
        durable_steps = max(2, steps // 10)
        results["durable_sequential"] = bench_durable(params, durable_steps, 1, "FULL", workdir, db_url)
        advance()
        results["durable_concurrent"] = bench_durable(params, durable_steps, workers, "FULL", workdir, db_url)
        advance()
        results["durable_concurrent_normal"] = bench_durable(params, durable_steps, workers, "NORMAL", workdir, db_url)
        advance()
        results["http"] = bench_http(params, http_requests, workdir, db_url)
        advance()
    return results
