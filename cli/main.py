"""The ``staleflow`` command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import httpx
import typer
from pydantic import ValidationError
from rich.table import Table

from staleflow.cli.common import (
    DEFAULT_MANAGER_URL,
    DEFAULT_STATE_DIR,
    console,
    fail,
    resolve_url,
    validation_failure,
)
from staleflow.config import LedgerConfig, ManagerConfig
from staleflow.servers.clients import ManagerClient, ServiceError

app = typer.Typer(help="StaleFlow: staleness-aware rollout coordination for asynchronous RL.", no_args_is_help=True)
serve_app = typer.Typer(help="Run one component in the foreground.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (not tests): measured numbers, side by side.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")
app.add_typer(db_app, name="db")
app.add_typer(bench_app, name="bench")

StateDir = Annotated[Path, typer.Option("--state-dir", help="the run's state directory")]
Eta = Annotated[int, typer.Option("--eta", help="staleness bound (>= 0)")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="prompt groups per training batch")]
GroupSize = Annotated[int, typer.Option("--group-size", help="trajectories per prompt group")]
ManagerUrl = Annotated[str | None, typer.Option("--url", help="staleness manager URL (default: the running job's)")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _manager_config(**fields: object) -> ManagerConfig:
    ledger_fields = {k: fields.pop(k) for k in list(fields) if k in LedgerConfig.model_fields}
    try:
        return ManagerConfig(ledger=LedgerConfig(**ledger_fields), **fields)
    except ValidationError as exc:
        raise validation_failure(exc) from None


def _run_manager(config: ManagerConfig) -> None:
    from staleflow.servers.http import serve_forever
    from staleflow.servers.ledger_store import SettingsMismatch
    from staleflow.servers.manager import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_forever(create_app(config), config.host, config.port)
    except (SettingsMismatch, OSError) as exc:
        raise fail(str(exc)) from None


@serve_app.command("manager")
def serve_manager(
    eta: Eta = 3,
    batch_size: BatchSize = 128,
    group_size: GroupSize = 16,
    batch_redundancy: Annotated[float, typer.Option(help="extra groups per batch, fraction of B")] = 0.0,
    group_redundancy: Annotated[float, typer.Option(help="extra trajectories per group, fraction of G")] = 0.0,
    db: Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in --state-dir)")] = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="bind port")] = 8321,
    synchronous: Annotated[str, typer.Option(help="SQLite sync level: FULL or NORMAL")] = "FULL",
) -> None:
    """The staleness manager: the durable Reserve/Occupy/Consume ledger behind REST."""
    config = _manager_config(
        eta=eta, batch_size=batch_size, group_size=group_size, batch_redundancy=batch_redundancy,
        group_redundancy=group_redundancy, db_url=db, state_dir=state_dir, host=host, port=port,
        synchronous=synchronous.upper(),
    )
    _run_manager(config)


@app.command()
def up(
    eta: Eta = 3,
    batch_size: BatchSize = 128,
    group_size: GroupSize = 16,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    port: Annotated[int, typer.Option(help="manager port")] = 8321,
) -> None:
    """Run StaleFlow on this machine. For now this starts the staleness manager in the foreground."""
    config = _manager_config(eta=eta, batch_size=batch_size, group_size=group_size, state_dir=state_dir, port=port)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "endpoints.json").write_text(json.dumps({"manager": {"url": f"http://127.0.0.1:{port}"}}, indent=2))
    console.print(f"state: {state_dir.resolve()}  manager: http://127.0.0.1:{port}  (Ctrl-C stops)")
    _run_manager(config)


@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in --state-dir)")] = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Create or upgrade the database schema (the manager also does this when it starts)."""
    from staleflow.servers import db as database

    url = _manager_config(db_url=db, state_dir=state_dir).database_url()
    try:
        current = database.upgrade(database.make_engine(url), revision)
    except Exception as exc:  # alembic and driver errors: say what failed, not where
        raise fail(f"could not upgrade {url}: {exc}", "check the --db URL and that the database is reachable") from None
    console.print(f"{url}: schema at revision {current}")


def _buffer_table(data: dict) -> Table:
    table = Table(title=f"train version {data['train_version']}  eta={data['eta']}  batch={data['batch_size']}")
    for col in ("buffer", "state", "occupied", "reserved", "empty", "v_traj of entries"):
        table.add_column(col)
    colors = {"ready": "green", "stuck": "red", "waiting": "yellow"}
    for b in data["buffers"]:
        occupied = sum(e["status"] == "occupied" for e in b["entries"])
        reserved = len(b["entries"]) - occupied
        versions = sorted({e["v_traj"] for e in b["entries"]})
        table.add_row(
            str(b["version"]), f"[{colors[b['state']]}]{b['state']}[/]", str(occupied), str(reserved),
            str(b["capacity"] - len(b["entries"])), ", ".join(map(str, versions)) or "-",
        )
    return table


@app.command()
def buffers(url: ManagerUrl = None, state_dir: StateDir = DEFAULT_STATE_DIR, as_json: AsJson = False) -> None:
    """Show the staleness buffers of a running manager."""
    url = resolve_url(url, "manager", state_dir, "STALEFLOW_MANAGER_URL", DEFAULT_MANAGER_URL)
    try:
        with ManagerClient(url) as client:
            data = client.buffers()
    except httpx.TransportError as exc:
        raise fail(f"no staleness manager answers at {url} ({exc.__class__.__name__})",
                   "start one with `staleflow up` or `staleflow serve manager`, or pass --url") from None
    except ServiceError as exc:
        raise fail(f"the manager at {url} refused: {exc}") from None
    if as_json:
        console.print_json(json.dumps(data))
    else:
        console.print(_buffer_table(data))


def _register_optional_commands() -> None:
    from staleflow.cli import bench

    bench.register(bench_app)
    try:
        from staleflow.cli import serve_instance
    except ImportError:  # the instance server is optional while it lands
        return
    serve_instance.register(serve_app)


_register_optional_commands()
