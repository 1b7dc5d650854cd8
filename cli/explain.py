"""Asking the ledger why: ``staleflow buffers --why [V]`` (why a buffer is not consumable yet, from
the coordinator) and ``staleflow admission`` (what the ledger admits, and whether N more groups of
version V would fit now)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from staleflow.api.coordinator import BufferExplanationOut, CoordinatorClient
from staleflow.api.manager import ManagerClient
from staleflow.cli.common import DEFAULT_MANAGER_URL, DEFAULT_STATE_DIR, ask, console, fail, resolve_url
from staleflow.cli.ray_launcher import Launcher, Namespace, RayAddress, job_endpoints

DEFAULT_COORDINATOR_URL = "http://127.0.0.1:8340"


def _urls(state_dir: Path, launcher: str, namespace: str | None, ray_address: str | None) -> dict[str, str]:
    on_ray = job_endpoints(launcher, namespace, ray_address, state_dir)
    if on_ray:
        return {name: on_ray[name]["url"] for name in ("manager", "coordinator")}
    return {"manager": resolve_url(None, "manager", state_dir, "STALEFLOW_MANAGER_URL", DEFAULT_MANAGER_URL),
            "coordinator": resolve_url(None, "coordinator", state_dir, "STALEFLOW_COORDINATOR_URL",
                                       DEFAULT_COORDINATOR_URL)}


def why(version: int | None, manager_url: str | None, coordinator_url: str | None, state_dir: Path, as_json: bool,
        launcher: str, namespace: str | None, ray_address: str | None) -> None:
    """``staleflow buffers --why [V]``: the coordinator's explanation of buffer V (default: the next to train)."""
    urls = _urls(state_dir, launcher, namespace, ray_address)
    coordinator_url = coordinator_url or urls["coordinator"]
    if version is None:
        version = ask(ManagerClient, manager_url or urls["manager"], "staleness manager", state_dir,
                      lambda m: m.health()).train_version
    answer = ask(CoordinatorClient, coordinator_url, "coordinator", state_dir, lambda c: c.explain_buffer(version))
    if as_json:
        typer.echo(answer.model_dump_json())
        return
    console.print(explanation_text(answer))
    if answer.groups:
        console.print(_groups_table(answer))


def explanation_text(answer: BufferExplanationOut) -> str:
    colors = {"ready": "green", "stuck": "red", "waiting": "yellow", "consumed": "blue"}
    summary = f"[{colors.get(answer.state, 'white')}]{escape(answer.summary)}[/]"
    if answer.consumable or answer.state == "consumed":
        return summary
    return f"{summary}\n[bold]estimate:[/] {escape(answer.estimate)}"


def _groups_table(answer: BufferExplanationOut) -> Table:
    table = Table(title=f"what buffer {answer.version} waits for")
    for col in ("group", "in buffer", "must occupy", "members done", "group ready in", "trajectory", "where",
                "tokens", "ready in"):
        table.add_column(col)
    for g in answer.groups:
        first = True
        for t in g.trajectories or [None]:
            group_cells = (escape(g.group_id), str(g.buffer), "yes" if g.required else "",
                           f"{g.completed}/{g.needed}", _seconds(g.ready_in_s)) if first else ("",) * 5
            first = False
            if t is None:
                table.add_row(*group_cells, "-", escape(g.note), "", "")
                continue
            tokens = f"{t.generated}/{t.max_tokens}" if t.max_tokens else str(t.generated)
            table.add_row(*group_cells, escape(t.traj_id), escape(t.where), tokens, _seconds(t.ready_in_s))
    return table


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"


def register(app: typer.Typer) -> None:
    @app.command()
    def admission(
        version: Annotated[int | None, typer.Option("--version", min=0, help=(
            "what if: could --count more groups with this V_traj be reserved now, and if not, why"))] = None,
        count: Annotated[int | None, typer.Option("--count", min=1, help="what if: how many groups (default 1)")]
        = None,
        url: Annotated[str | None, typer.Option("--url", help="staleness manager URL (default: the running job's)")]
        = None,
        state_dir: Annotated[Path, typer.Option("--state-dir", help="the run's state directory")] = DEFAULT_STATE_DIR,
        as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
        launcher: Launcher = "local", namespace: Namespace = None, ray_address: RayAddress = None,
    ) -> None:
        """How many new groups the ledger admits at each V_traj; with --version, whether --count more
        would fit now, and if not, which buffers are full and what must be consumed first."""
        if count is not None and version is None:
            raise fail("--count asks about a version: give --version too", "e.g. staleflow admission --version 3 "
                       f"--count {count}")
        count = count or 1
        url = url or _urls(state_dir, launcher, namespace, ray_address)["manager"]
        asked = {"version": version, "count": count} if version is not None else {}
        answer = ask(ManagerClient, url, "staleness manager", state_dir, lambda m: m.admission(**asked))
        if as_json:
            typer.echo(answer.model_dump_json())
            return
        table = Table(title=f"admission at train version {answer.train_version}  eta={answer.eta}")
        table.add_column("v_traj")
        table.add_column("groups it admits now")
        for v, n in answer.admissible.items():
            table.add_row(v, str(n))
        console.print(table)
        what_if = answer.what_if
        if what_if:
            verdict = "[green]yes[/]" if what_if.admissible else "[red]no[/]"
            console.print(f"{count} more with v_traj {version}? {verdict}: {escape(what_if.reason)}")
