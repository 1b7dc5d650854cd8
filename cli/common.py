"""Shared CLI plumbing: finding a running job, printing errors people can act on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

DEFAULT_STATE_DIR = Path(".staleflow")
DEFAULT_MANAGER_URL = "http://127.0.0.1:8321"


def fail(message: str, fix: str | None = None, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}")
    if fix:
        err_console.print(f"[bold]fix:[/] {fix}")
    return typer.Exit(code)


def validation_failure(exc: ValidationError, flag_names: dict[str, str] | None = None) -> typer.Exit:
    flag_names = flag_names or {}
    lines = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "config"
        flag = flag_names.get(field, "--" + field.split(".")[-1].replace("_", "-"))
        lines.append(f"{field} ({flag}): {error['msg']}")
    return fail("invalid configuration:\n  " + "\n  ".join(lines), "correct the values named above")


def endpoints(state_dir: Path) -> dict:
    path = state_dir / "endpoints.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            return {}
    return {}


def resolve_url(url: str | None, component: str, state_dir: Path, env_var: str, default: str) -> str:
    """--url, else the environment, else a running job's endpoints.json, else the default."""
    return url or os.environ.get(env_var) or endpoints(state_dir).get(component, {}).get("url") or default


def job_token(state_dir: Path) -> str | None:
    """The token of the job in ``state_dir`` (from the file endpoints.json names), if any."""
    from staleflow.servers.auth import configured_token, read_token_file

    path = endpoints(state_dir).get("token_file")
    return configured_token(read_token_file(Path(path)) if path else None)
