"""Asking the ledger why: ``staleflow buffers --why [V]`` (why a buffer is not consumable yet, from
the coordinator) and ``staleflow admission`` (what the ledger admits, and whether N more groups of
version V would fit now)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from staleflow.api.coordinator import BufferExplanationOut, CoordinatorClient, GroupWaitOut
from staleflow.api.manager import ManagerClient
from staleflow.cli.common import DEFAULT_MANAGER_URL, DEFAULT_STATE_DIR, ask, console, fail, resolve_url
from staleflow.cli.ray_launcher import Launcher, Namespace, RayAddress, job_endpoints
from staleflow.cli.tables import fitted_table

DEFAULT_COORDINATOR_URL = "http://127.0.0.1:8340"


def _urls(state_dir: Path, launcher: str, namespace: str | None, ray_address: str | None) -> dict[str, str]:
    on_ray = job_endpoints(launcher, namespace, ray_address, state_dir)
    if on_ray:
        return {name: on_ray[name]["url"] for name in ("manager", "coordinator")}
    return {"manager": resolve_url(None, "manager", state_dir, "STALEFLOW_MANAGER_URL", DEFAULT_MANAGER_URL),
            "coordinator": resolve_url(None, "coordinator", state_dir, "STALEFLOW_COORDINATOR_URL",
                                       DEFAULT_COORDINATOR_URL)}


REREADS = 5  # a buffer consumed while we asked: ask again about the one the trainer waits for now, this often


def why(version: int | None, manager_url: str | None, coordinator_url: str | None, state_dir: Path, as_json: bool,
        launcher: str, namespace: str | None, ray_address: str | None, verbose: bool = False) -> None:
    """``staleflow buffers --why [V]``: the coordinator's explanation of buffer V (default: the one the
    trainer waits for next; if the trainer consumes it while we ask, the next one)."""
    urls = _urls(state_dir, launcher, namespace, ray_address)
    coordinator_url = coordinator_url or urls["coordinator"]

    def explain(v: int) -> BufferExplanationOut:
        return ask(CoordinatorClient, coordinator_url, "coordinator", state_dir, lambda c: c.explain_buffer(v))

    if version is not None:
        answer = explain(version)
    else:
        answer = explain(ask(ManagerClient, manager_url or urls["manager"], "staleness manager", state_dir,
                             lambda m: m.health()).train_version)
        for _ in range(REREADS):
            if answer.state != "consumed":
                break
            answer = explain(answer.train_version)  # a consumed buffer's answer says where the trainer is now
    if as_json:
        typer.echo(answer.model_dump_json())
        return
    console.print(explanation_text(answer))
    if answer.groups:
        console.print(_groups_table(answer))
        if verbose:
            console.print(_trajectories_table(answer))


def explanation_text(answer: BufferExplanationOut) -> str:
    colors = {"ready": "green", "stuck": "red", "waiting": "yellow", "consumed": "blue"}
    summary = f"[{colors.get(answer.state, 'white')}]{escape(answer.summary)}[/]"
    if answer.consumable or answer.state == "consumed":
        return summary
    return f"{summary}\n[bold]estimate:[/] {escape(answer.estimate)}"


def _open_members(group: GroupWaitOut) -> str:
    """Where a group's unfinished members are, in words: how many where, and the furthest along."""
    where: dict[str, list[int]] = {}
    for t in group.trajectories:
        if t.ready_in_s == 0:
            continue  # done
        place = t.where.split(":")[0] if t.state == "pending" else t.where
        where.setdefault(place, []).append(t.generated)
    if not where:
        return escape(group.note)
    budget = f"/{group.trajectories[0].max_tokens}" if group.trajectories[0].max_tokens else ""
    return "; ".join(f"{len(tokens)} {escape(place)} (up to {max(tokens)}{budget} tokens)" if max(tokens) else
                     f"{len(tokens)} {escape(place)}" for place, tokens in where.items())


def _groups_table(answer: BufferExplanationOut) -> Table:
    table = fitted_table(f"what buffer {answer.version} waits for (--verbose: each trajectory)", "group", "buffer",
                         "required", "done", "ready in", "open members", wrap=("open members",))
    for g in answer.groups:
        table.add_row(escape(g.group_id), str(g.buffer), "yes" if g.required else "", f"{g.completed}/{g.needed}",
                      _seconds(g.ready_in_s), _open_members(g))
    return table


def _trajectories_table(answer: BufferExplanationOut) -> Table:
    table = fitted_table("each trajectory of those groups", "trajectory", "group", "where", "tokens", "ready in",
                         wrap=("where", "ready in"))
    for g in answer.groups:
        if not g.trajectories:
            table.add_row("-", escape(g.group_id), escape(g.note), "", "")
        for t in g.trajectories:
            tokens = f"{t.generated}/{t.max_tokens}" if t.max_tokens else str(t.generated)
            table.add_row(escape(t.traj_id), escape(g.group_id), escape(t.where), tokens, _seconds(t.ready_in_s))
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
