"""The ``staleflow`` command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from staleflow.api.base import ServiceClient, ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.api.manager import BuffersOut, ManagerClient
from staleflow.cli.common import (
    DEFAULT_MANAGER_URL,
    DEFAULT_STATE_DIR,
    ask,
    console,
    endpoints,
    fail,
    job_token,
    readable,
    resolve_url,
    validation_failure,
)
from staleflow.cli.ray_launcher import Launcher, Namespace, RayAddress, job_endpoints
from staleflow.cli.tables import WIDE, fitted_table, headline
from staleflow.config import LedgerConfig, ManagerConfig, default_of

app = typer.Typer(help="StaleFlow: staleness-aware rollout coordination for asynchronous RL.", no_args_is_help=True)
serve_app = typer.Typer(help="Run one component in the foreground.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (not tests): measured numbers, side by side.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")


@serve_app.callback()
def _serve_privately(ctx: typer.Context) -> None:
    """Run one component in the foreground."""
    from staleflow.servers.auth import private_files

    ctx.with_resource(private_files())  # its state files are owner-only from creation
app.add_typer(db_app, name="db")
app.add_typer(bench_app, name="bench")

StateDir = Annotated[Path, typer.Option("--state-dir", help="the run's state directory")]
Eta = Annotated[int, typer.Option("--eta", help="staleness bound (>= 0)")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="prompt groups per training batch")]
GroupSize = Annotated[int, typer.Option("--group-size", help="trajectories per prompt group")]
ManagerUrl = Annotated[str | None, typer.Option("--url", help="staleness manager URL (default: the running job's)")]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]


def _manager_config(**fields: Any) -> ManagerConfig:
    ledger_fields = {k: fields.pop(k) for k in list(fields) if k in LedgerConfig.model_fields}
    try:
        return ManagerConfig(ledger=LedgerConfig(**ledger_fields), **fields)
    except ValidationError as exc:
        raise validation_failure(exc) from None


def _run_manager(config: ManagerConfig, token: str | None = None) -> None:
    from staleflow.database_url import DatabaseUrlError
    from staleflow.servers.auth import InsecureBind
    from staleflow.servers.http import serve_forever
    from staleflow.servers.manager import create_app
    from staleflow.servers.manager.store import LedgerInUse, SettingsMismatch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_forever(create_app(config), config.host, config.port, token=token)
    except (SettingsMismatch, LedgerInUse, DatabaseUrlError, OSError, InsecureBind) as exc:
        raise fail(str(exc)) from None


@serve_app.command("manager")
def serve_manager(
    eta: Eta = default_of(LedgerConfig, "eta"),
    batch_size: BatchSize = default_of(LedgerConfig, "batch_size"),
    group_size: GroupSize = default_of(LedgerConfig, "group_size"),
    batch_redundancy: Annotated[float, typer.Option(help="extra groups per batch, fraction of B")]
    = default_of(LedgerConfig, "batch_redundancy"),
    group_redundancy: Annotated[float, typer.Option(help="extra trajectories per group, fraction of G")]
    = default_of(LedgerConfig, "group_redundancy"),
    db: Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in --state-dir)")] = None,
    state_dir: StateDir = default_of(ManagerConfig, "state_dir"),
    host: Annotated[str, typer.Option(help="bind address")] = default_of(ManagerConfig, "host"),
    port: Annotated[int, typer.Option(help="bind port")] = default_of(ManagerConfig, "port"),
    synchronous: Annotated[str, typer.Option(help="SQLite sync level: FULL or NORMAL")]
    = default_of(ManagerConfig, "synchronous"),
    token: Annotated[str | None, typer.Option(help="bearer token for mutating requests (default: $STALEFLOW_TOKEN)")] = None,
) -> None:
    """The staleness manager: the durable Reserve/Occupy/Consume ledger behind REST."""
    config = _manager_config(
        eta=eta, batch_size=batch_size, group_size=group_size, batch_redundancy=batch_redundancy,
        group_redundancy=group_redundancy, db_url=db, state_dir=state_dir, host=host, port=port,
        synchronous=synchronous.upper(),
    )
    _run_manager(config, token)


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
        raise fail(f"could not upgrade {database.masked(url)}: {exc}",
                   "check the --db URL and that the database is reachable") from None
    console.print(f"{database.masked(url)}: schema at revision {current}")


def _buffer_table(data: BuffersOut) -> Table:
    table = fitted_table(f"train version {data.train_version}  eta={data.eta}  batch={data.batch_size}",
                         "buffer", "state", "occupied", "reserved", "empty", "v_traj of entries",
                         wrap=("v_traj of entries",))
    colors = {"ready": "green", "stuck": "red", "waiting": "yellow"}
    for b in data.buffers:
        occupied = sum(e.status == "occupied" for e in b.entries)
        reserved = len(b.entries) - occupied
        versions = sorted({e.v_traj for e in b.entries if e.v_traj is not None})
        table.add_row(
            str(b.version), f"[{colors[b.state]}]{b.state}[/]", str(occupied), str(reserved),
            str(b.capacity - len(b.entries)), ", ".join(map(str, versions)) or "-",
        )
    return table


@app.command()
def buffers(version: Annotated[int | None, typer.Argument(
                min=0, metavar="VERSION", help="only this buffer (with --why: default the next to train)")] = None,
            why: Annotated[bool, typer.Option("--why", help=(
                "why the buffer is not consumable yet: the groups it waits for, where their trajectories run, "
                "how far they got, and when the cost model expects it ready (asks the coordinator)"))] = False,
            coordinator_url: Annotated[str | None, typer.Option(
                "--coordinator-url", help="with --why: coordinator URL (default: the running job's)")] = None,
            url: ManagerUrl = None, state_dir: StateDir = DEFAULT_STATE_DIR, as_json: AsJson = False,
            verbose: Annotated[bool, typer.Option("--verbose", "-v", help="with --why: each trajectory it waits for")]
            = False, launcher: Launcher = "local", namespace: Namespace = None, ray_address: RayAddress = None) -> None:
    """Show the staleness buffers of a running manager; --why explains one."""
    if why:
        from staleflow.cli.explain import why as explain_why

        explain_why(version, url, coordinator_url, state_dir, as_json, launcher, namespace, ray_address, verbose)
        return
    on_ray = job_endpoints(launcher, namespace, ray_address, state_dir)
    url = url or (on_ray["manager"]["url"] if on_ray else
                  resolve_url(url, "manager", state_dir, "STALEFLOW_MANAGER_URL", DEFAULT_MANAGER_URL))
    try:
        with ManagerClient(url, token=job_token(state_dir)) as client:
            data = client.buffers()
    except httpx.TransportError as exc:
        raise fail(f"no staleness manager answers at {url} ({exc.__class__.__name__})",
                   "start one with `staleflow up` or `staleflow serve manager`, or pass --url") from None
    except ServiceError as exc:
        raise fail(f"the manager at {url} refused: {exc}") from None
    if version is not None:
        live = [b for b in data.buffers if b.version == version]
        if not live:
            first, last = data.train_version, data.train_version + data.eta
            raise fail(f"buffer {version} is not live: the live buffers are {first}..{last}",
                       "ask about one of them, or `staleflow buffers --why VERSION` for a consumed one")
        data = data.model_copy(update={"buffers": live})
    if as_json:
        typer.echo(data.model_dump_json(exclude_none=True))
    else:
        console.print(_buffer_table(data))


CoordinatorUrl = Annotated[str | None, typer.Option("--url", help="coordinator URL (default: the running job's)")]


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="every column and detail (wide terminals get more "
                                                                  "by default)")]


@app.command()
def instances(url: CoordinatorUrl = None, state_dir: StateDir = DEFAULT_STATE_DIR, as_json: AsJson = False,
              verbose: Verbose = False, launcher: Launcher = "local", namespace: Namespace = None,
              ray_address: RayAddress = None) -> None:
    """Rollout instances as the coordinator sees them: snapshot, speculative state, status."""
    on_ray = job_endpoints(launcher, namespace, ray_address, state_dir)
    url = url or (on_ray["coordinator"]["url"] if on_ray else
                  resolve_url(url, "coordinator", state_dir, "STALEFLOW_COORDINATOR_URL", "http://127.0.0.1:8340"))
    data = ask(CoordinatorClient, url, "coordinator", state_dir, lambda c: c.instances())
    if as_json:
        typer.echo(data.model_dump_json())
        return
    wide = console.width >= WIDE  # room for the speculative state in the table
    headers = ["instance", "status", "version", "running", "waiting", "done", "KV tokens", "tokens/s"]
    table = fitted_table(f"instances (parameter server at version {data.ps_version})",
                         *headers, *(["speculative P"] if wide else []), wrap=("KV tokens",))
    speculative = {i.instance_id: f"v{(i.speculative or {}).get('inst_version', '-')}/"
                                  f"{(i.speculative or {}).get('accum_traj_num', '-')}" for i in data.instances}
    for i in data.instances:
        s = i.snapshot or {}
        kv = s.get("kv_cache")
        table.add_row(escape(i.instance_id), i.status, str(s.get("inst_version", "-")),
                      str(len(s.get("run_trajs") or [])), str(len(s.get("wait_trajs") or [])),
                      str(len(s.get("complete_trajs") or [])), "-" if kv is None else f"{kv:,.0f}",
                      f"{i.estimated_throughput:,.0f}", *([speculative[i.instance_id]] if wide else []))
    console.print(table)
    if verbose and not wide:  # no room for another column: below the table, in words that wrap
        console.print("speculative P (version/trajectories routed since its last pull): "
                      + ", ".join(f"{escape(i)} {p}" for i, p in speculative.items()))


@app.command()
def commands(url: CoordinatorUrl = None, state_dir: StateDir = DEFAULT_STATE_DIR, limit: int = 20,
             as_json: AsJson = False) -> None:
    """The coordinator's most recent commands with their timing and outcome."""
    url = resolve_url(url, "coordinator", state_dir, "STALEFLOW_COORDINATOR_URL", "http://127.0.0.1:8340")
    data = ask(CoordinatorClient, url, "coordinator", state_dir, lambda c: c.commands(limit=limit))
    if as_json:
        typer.echo(data.model_dump_json())
        return
    table = fitted_table("recent commands", "command", "instance", "kind", "size", "ms", "outcome", wrap=("outcome",))
    for c in data.commands:
        ms = f"{1e3 * (c.completed_at - c.issued_at):.1f}" if c.completed_at else "-"
        table.add_row(escape(c.command_id), escape(c.instance_id), c.kind, str(c.size), ms, escape(c.outcome))
    console.print(table)


def _health_detail(health: dict) -> str:
    """A component's whole health in one cell, in words the table wraps between (never cut); the
    TS's skipped prompts first, as they need acting on."""
    rest = "; ".join(f"{key}: {readable(value)}" for key, value in health.items()
                     if key not in ("status", "skipped_prompts"))
    skipped = health.get("skipped_prompts")
    if isinstance(skipped, dict) and skipped.get("count"):
        reasons = ", ".join(f"{n} {reason}" for reason, n in (skipped.get("reasons") or {}).items())
        return f"skipped prompts: {skipped['count']} ({reasons}); {rest}"
    return rest


@app.command()
def status(state_dir: StateDir = DEFAULT_STATE_DIR, as_json: AsJson = False, verbose: Verbose = False,
           launcher: Launcher = "local", namespace: Namespace = None, ray_address: RayAddress = None) -> None:
    """Every component of the running job in --state-dir (or Ray namespace): up or not, and its headline
    numbers (--verbose: every detail of its health)."""
    known = job_endpoints(launcher, namespace, ray_address, state_dir) or endpoints(state_dir)
    if not known:
        raise fail(f"no job in {state_dir} (no endpoints.json)", "start one with `staleflow up`, or pass --state-dir")
    rows = {}
    for name, info in known.items():
        if not isinstance(info, dict) or "url" not in info:
            continue
        try:
            with ServiceClient(info["url"], timeout=3) as client:
                rows[name] = {"url": info["url"], "up": True, "health": client.health()}
        except (httpx.HTTPError, ServiceError, ValueError):
            rows[name] = {"url": info["url"], "up": False, "health": None}
    if as_json:
        typer.echo(json.dumps(rows))
        return
    title = (f"job in Ray namespace {namespace or endpoints(state_dir).get('namespace')}"
             if launcher == "ray" else f"job in {state_dir}")
    with_url = verbose or console.width >= WIDE
    table = fitted_table(title, "component", "state", *(["url"] if with_url else []),
                         "details" if verbose else "headline", wrap=("details", "headline"))
    for name, row in rows.items():
        detail = _health_detail(row["health"] or {}) if verbose else headline(row["health"])
        state = "[green]up[/]" if row["up"] else "[red]down[/]"
        table.add_row(escape(name), state, *([escape(row["url"])] if with_url else []), escape(detail))
    console.print(table)


def _register_commands() -> None:
    from staleflow.cli import (
        bench,
        bench_params,
        bench_systems,
        calibrate,
        demo,
        experiment_staleness,
        explain,
        faults,
        ray_launcher,
        serve_instance,
        serve_params,
        serve_reward,
        soak,
        up,
    )

    bench.register(bench_app)
    bench_params.register(bench_app)
    bench_systems.register(bench_app)
    calibrate.register(app)
    demo.register(app)
    experiment_staleness.register(app)
    explain.register(app)
    faults.register(app)
    ray_launcher.register(app)
    serve_instance.register(serve_app)
    serve_params.register(serve_app)
    serve_reward.register(serve_app)
    soak.register(app)
    up.register(app, serve_app)


_register_commands()
