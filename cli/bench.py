"""``staleflow bench ledger`` and ``staleflow bench coordinator``: their command lines; the measuring
lives with the manager (``staleflow.servers.manager.bench``) and the simulation
(``staleflow.simulation.decision_bench``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from staleflow.cli.common import console, emit_results, fail
from staleflow.servers.manager.bench import LEDGER_BENCH_PARTS, run_ledger_bench
from staleflow.simulation.decision_bench import DECISION_STRATEGIES, decision_bench_cells, run_decision_bench


def _print(results: dict) -> None:
    table = Table(title=f"ledger benchmark (eta={results['params']['eta']}, B={results['params']['batch_size']}, "
                        f"{results['params']['database']})")
    table.add_column("measurement")
    table.add_column("result", justify="right")
    table.add_column("goal", justify="right")
    table.add_column("CPU us per op", justify="right")
    table.add_row("pure ledger transitions/s", f"{results['pure']['per_second']:,.0f}", ">= 100,000",
                  f"{results['pure']['cpu_us_per_transition']:,.1f}")
    for key, label in (
        ("durable_sequential", "durable transitions/s, 1 client, FULL sync"),
        ("durable_concurrent", f"durable transitions/s, {results['durable_concurrent']['workers']} clients, FULL sync"),
        ("durable_concurrent_normal", f"durable transitions/s, {results['durable_concurrent']['workers']} clients, NORMAL sync"),
    ):
        table.add_row(label, f"{results[key]['per_second']:,.0f}", ">= 5,000", f"{results[key]['cpu_us_per_transition']:,.0f}")
    for op in ("reserve", "occupy"):
        h = results["http"][op]
        table.add_row(f"HTTP {op} latency p50 / p99 (ms)", f"{h['p50_ms']:.2f} / {h['p99_ms']:.2f}", "p50 <= 2",
                      f"{results['http']['cpu_us_per_request']:,.0f} (a request)" if op == "reserve" else "")
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
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("ledger benchmark", total=LEDGER_BENCH_PARTS)
            results = run_ledger_bench(eta, batch_size, steps, http_requests, workers, db,
                                       advance=lambda: progress.advance(task))
        results["threads_alive"] = threading.active_count()  # after the progress bar's thread has stopped
        emit_results(results, output, as_json, _print)


def _print_decisions(results: dict) -> None:
    for scenario in ("initial fill", "steady"):
        rows = [r for r in results["rows"] if r["scenario"] == scenario]
        counts = sorted({r["trajectories"] for r in rows})
        table = Table(title=f"decision pass (sync + migration + routing), ms (min CPU ms, peak MiB), {scenario}, "
                            f"{results['strategy']} strategy")
        table.add_column("instances \\ trajectories")
        for c in counts:
            table.add_column(str(c), justify="right")
        for n in sorted({r["instances"] for r in rows}):
            cells = {r["trajectories"]: r for r in rows if r["instances"] == n}
            table.add_row(str(n), *(f"{cells[c]['median_ms']:.1f} (CPU {cells[c]['cpu_min_ms']:.1f}, "
                                    f"{cells[c]['peak_mib']:.1f} MiB, {cells[c]['routed']} routed)" for c in counts))
        console.print(table)


def register_decision_bench(bench_app: typer.Typer) -> None:
    @bench_app.command("coordinator")
    def coordinator_cmd(
        instances: Annotated[str, typer.Option(help="comma-separated instance counts")] = "16,32,64,128",
        trajectories: Annotated[str, typer.Option(help="comma-separated waiting-trajectory counts")] = "256,512,1024,2048",
        repeats: Annotated[int, typer.Option(help="passes per cell (median reported)")] = 5,
        strategy: Annotated[str, typer.Option(help="default (the coordinator's StrategyConfig()), staleflow "
                                              "(load-aware sync, starved migration, as bench systems runs it) or "
                                              "repack (staleflow with repack, every pass a repack check)")
                            ] = "default",
        as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    ) -> None:
        """Time of one coordinator decision pass as instances and waiting trajectories grow."""
        if strategy not in DECISION_STRATEGIES:
            raise fail(f"--strategy must be one of {', '.join(DECISION_STRATEGIES)}, got {strategy!r}")
        instance_counts = [int(x) for x in instances.split(",")]
        trajectory_counts = [int(x) for x in trajectories.split(",")]
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("decision passes", total=decision_bench_cells(instance_counts, trajectory_counts))
            results = run_decision_bench(instance_counts, trajectory_counts, repeats, strategy,
                                         advance=lambda: progress.advance(task))
        if as_json:
            typer.echo(json.dumps(results))
        else:
            _print_decisions(results)
