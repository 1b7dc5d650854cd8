"""``staleflow bench ledger``: the ledger's speed, measured side by side in one run."""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from staleflow.cli.common import console, emit_results, fail
from staleflow.config import LedgerConfig, ManagerConfig
from staleflow.config.manager import LedgerParams
from staleflow.ledger import Ledger


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
    ops, start = 0, time.perf_counter()
    for _ in range(steps):
        ops += _fill_and_drain(ledger, params, "p")
    elapsed = time.perf_counter() - start
    return {"transitions": ops, "seconds": elapsed, "per_second": ops / elapsed}


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
        ops, start = 0, time.perf_counter()
        for _ in range(steps):
            ops += _fill_and_drain(ledger, params, f"d{workers}", workers)
        elapsed = time.perf_counter() - start
    finally:
        ledger.close()
    return {"transitions": ops, "seconds": elapsed, "per_second": ops / elapsed, "workers": workers,
            "synchronous": synchronous}


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
        done = 0
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
    return {
        op: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * _percentile(v, 0.99), "n": len(v)}
        for op, v in latencies.items()
    }


def run_ledger_bench(eta: int, batch_size: int, steps: int, http_requests: int, workers: int,
                     db_url: str | None = None) -> dict:
    """``db_url``: run the durable and HTTP parts on this database (its StaleFlow tables are dropped
    before each part) instead of temporary SQLite files."""
    params = LedgerParams(eta=eta, batch_size=batch_size)
    database = "sqlite (temporary files)"
    if db_url is not None:
        from staleflow.servers.db import masked

        database = masked(db_url)
    results: dict = {"params": {"eta": eta, "batch_size": batch_size, "steps": steps, "database": database}}
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console, transient=True) as progress:
        workdir = Path(tmp)
        task = progress.add_task("ledger benchmark", total=5)
        results["pure"] = bench_pure(params, steps)
        progress.advance(task)
        durable_steps = max(2, steps // 10)
        results["durable_sequential"] = bench_durable(params, durable_steps, 1, "FULL", workdir, db_url)
        progress.advance(task)
        results["durable_concurrent"] = bench_durable(params, durable_steps, workers, "FULL", workdir, db_url)
        progress.advance(task)
        results["durable_concurrent_normal"] = bench_durable(params, durable_steps, workers, "NORMAL", workdir, db_url)
        progress.advance(task)
        results["http"] = bench_http(params, http_requests, workdir, db_url)
        progress.advance(task)
    results["threads_alive"] = threading.active_count()
    return results


def _print(results: dict) -> None:
    table = Table(title=f"ledger benchmark (eta={results['params']['eta']}, B={results['params']['batch_size']}, "
                        f"{results['params']['database']})")
    table.add_column("measurement")
    table.add_column("result", justify="right")
    table.add_column("goal", justify="right")
    table.add_row("pure ledger transitions/s", f"{results['pure']['per_second']:,.0f}", ">= 100,000")
    for key, label in (
        ("durable_sequential", "durable transitions/s, 1 client, FULL sync"),
        ("durable_concurrent", f"durable transitions/s, {results['durable_concurrent']['workers']} clients, FULL sync"),
        ("durable_concurrent_normal", f"durable transitions/s, {results['durable_concurrent']['workers']} clients, NORMAL sync"),
    ):
        table.add_row(label, f"{results[key]['per_second']:,.0f}", ">= 5,000")
    for op in ("reserve", "occupy"):
        h = results["http"][op]
        table.add_row(f"HTTP {op} latency p50 / p99 (ms)", f"{h['p50_ms']:.2f} / {h['p99_ms']:.2f}", "p50 <= 2")
    console.print(table)


def register(bench_app: typer.Typer) -> None:
    from staleflow.cli import bench_trainer

    register_decision_bench(bench_app)
    bench_trainer.register(bench_app)

    @bench_app.command("ledger")
    def ledger_cmd(
        eta: Annotated[int, typer.Option(help="staleness bound")] = 3,
        batch_size: Annotated[int, typer.Option(help="groups per buffer")] = 128,
        steps: Annotated[int, typer.Option(help="training steps for the pure-ledger run")] = 400,
        http_requests: Annotated[int, typer.Option(help="reserve+occupy pairs over HTTP")] = 1000,
        workers: Annotated[int, typer.Option(help="concurrent clients for the durable run")] = 16,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
        output: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
        db: Annotated[str | None, typer.Option("--db", help="database for the durable and HTTP runs, e.g. "
                                               "postgresql+psycopg://... (its StaleFlow tables are DROPPED); "
                                               "default: temporary SQLite files")] = None,
    ) -> None:
        """Pure-ledger transitions/s, durable transitions/s through SQLite or PostgreSQL, HTTP latency."""
        if db is not None:
            from staleflow.database_url import DatabaseUrlError, normalize_url

            try:
                normalize_url(db)
            except DatabaseUrlError as exc:
                raise fail(str(exc)) from None
        results = run_ledger_bench(eta, batch_size, steps, http_requests, workers, db)
        emit_results(results, output, as_json, _print)


def _decision_scenario(n_instances: int, n_trajectories: int, steady: bool, seed: int = 0):
    """Instances and waiting trajectories for one decision pass. ``steady``: a loaded fleet at
    mixed versions with partial trajectories waiting; otherwise an idle fleet and a fresh batch."""
    import random

    from staleflow.cost_model import CostModel
    from staleflow.strategies import InstanceState, PendingTrajectory

    rng = random.Random(seed)
    cost = CostModel()
    instances, pending = [], []
    for i in range(n_instances):
        if steady:
            running = rng.randint(5, 80)
            waiting = rng.choice([0, 0, 0, rng.randint(1, 8)])
            instances.append(InstanceState(f"i{i}", rng.choice([2, 3, 3, 4]), float(running * rng.randint(300, 3000)),
                                           [f"i{i}-r{k}" for k in range(running)],
                                           [f"i{i}-w{k}" for k in range(waiting)], cost))
        else:
            instances.append(InstanceState(f"i{i}", 0, 0.0, [], [], cost))
    group_size = 16
    prompt_lengths: dict[int, int] = {}
    for k in range(n_trajectories):
        g = k // group_size
        if steady and g % 3 == 0:  # interrupted partials of versioned groups
            pending.append(PendingTrajectory(f"t{k}", f"g{g}", rng.choice([1, 2, 3]), rng.randint(300, 15000), k))
        else:  # initial: the members of a group share their prompt
            length = prompt_lengths.setdefault(g, rng.randint(100, 2000))
            pending.append(PendingTrajectory(f"t{k}", f"g{g}", None, length, k))
    admission = {1: 0, 2: 64, 3: 128, 4: 256} if steady else {0: 10**6}
    return instances, pending, (4 if steady else 0), admission


def decision_strategy(name: str):
    """``default``: the coordinator's ``StrategyConfig()``; ``staleflow``: the strategies the
    simulated StaleFlow runs (load-aware sync, starved migration)."""
    from staleflow.config.strategy import StrategyConfig

    if name == "default":
        return StrategyConfig()
    from staleflow.simulation.systems import resolve

    return resolve("sf-rsm")[0].strategy


def run_decision_bench(instance_counts: list[int], trajectory_counts: list[int], repeats: int,
                       strategy: str = "default") -> dict:
    from staleflow.strategies import plan_cycle

    config = decision_strategy(strategy)
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decision passes", total=2 * len(instance_counts) * len(trajectory_counts))
        for steady in (False, True):
            for n_inst in instance_counts:
                for n_traj in trajectory_counts:
                    instances, pending, ps_version, admission = _decision_scenario(n_inst, n_traj, steady)
                    times, routed = [], 0
                    for _ in range(repeats):
                        start = time.perf_counter()
                        plan = plan_cycle(instances, pending, ps_version, admission, config)
                        times.append(1e3 * (time.perf_counter() - start))
                        routed = len(plan.routes)
                    rows.append({"scenario": "steady" if steady else "initial fill", "instances": n_inst,
                                 "trajectories": n_traj, "median_ms": statistics.median(times), "routed": routed,
                                 "syncs": len(plan.syncs), "interrupted": sum(map(len, plan.interrupts.values()))})
                    progress.advance(task)
    return {"repeats": repeats, "strategy": strategy, "rows": rows}


def _print_decisions(results: dict) -> None:
    for scenario in ("initial fill", "steady"):
        rows = [r for r in results["rows"] if r["scenario"] == scenario]
        counts = sorted({r["trajectories"] for r in rows})
        table = Table(title=f"decision pass (sync + migration + routing), ms, {scenario}, "
                            f"{results['strategy']} strategy")
        table.add_column("instances \\ trajectories")
        for c in counts:
            table.add_column(str(c), justify="right")
        for n in sorted({r["instances"] for r in rows}):
            cells = {r["trajectories"]: r for r in rows if r["instances"] == n}
            table.add_row(str(n), *(f"{cells[c]['median_ms']:.1f} ({cells[c]['routed']} routed)" for c in counts))
        console.print(table)


def register_decision_bench(bench_app: typer.Typer) -> None:
    @bench_app.command("coordinator")
    def coordinator_cmd(
        instances: Annotated[str, typer.Option(help="comma-separated instance counts")] = "16,32,64,128",
        trajectories: Annotated[str, typer.Option(help="comma-separated waiting-trajectory counts")] = "256,512,1024,2048",
        repeats: Annotated[int, typer.Option(help="passes per cell (median reported)")] = 5,
        strategy: Annotated[str, typer.Option(help="default (the coordinator's StrategyConfig()) or staleflow "
                                              "(load-aware sync, starved migration, as bench systems runs it)")
                            ] = "default",
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ) -> None:
        """Time of one coordinator decision pass as instances and waiting trajectories grow."""
        if strategy not in ("default", "staleflow"):
            raise fail(f"--strategy must be default or staleflow, got {strategy!r}")
        results = run_decision_bench([int(x) for x in instances.split(",")], [int(x) for x in trajectories.split(",")],
                                     repeats, strategy)
        if as_json:
            typer.echo(json.dumps(results))
        else:
            _print_decisions(results)
