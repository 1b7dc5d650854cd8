"""Shared CLI plumbing: finding a running job, printing errors people can act on."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.markup import escape

from staleflow.config.common import STATE_DIR
from staleflow.config.manager import MANAGER_URL

if TYPE_CHECKING:
    from staleflow.api.base import Client

console = Console()
err_console = Console(stderr=True)

DEFAULT_STATE_DIR = STATE_DIR
DEFAULT_MANAGER_URL = MANAGER_URL


def fail(message: str, fix: str | None = None, code: int = 2) -> typer.Exit:
    """Print ``error: message`` and ``fix: fix`` as given (no markup, no line breaks inserted into
    a command to copy) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    if fix:
        err_console.print(f"[bold]fix:[/] {escape(fix)}", soft_wrap=True)
    return typer.Exit(code)


def readable(value: Any) -> str:
    """A JSON value as words for a table cell: ``{"a": 1, "b": {"c": 2}}`` -> ``a 1, b (c 2)``."""
    if isinstance(value, dict):
        return ", ".join(f"{key} {readable(v) if not isinstance(v, dict) else f'({readable(v)})'}"
                         for key, v in value.items()) or "-"
    if isinstance(value, list | tuple):
        return ", ".join(readable(v) for v in value) or "-"
    return "-" if value is None else str(value)


_BOUNDS = {"greater_than_equal": ("ge", "{} or more"), "greater_than": ("gt", "more than {}"),
           "less_than_equal": ("le", "{} or less"), "less_than": ("lt", "less than {}")}
_KINDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "string": "a string",
          "dict": "a mapping of settings", "list": "a list", "path": "a path"}


def _fields_at(model: type[BaseModel] | None, loc: tuple) -> dict[str, Any]:
    """The settings of the (nested) model or dataclass that ``loc`` points into (with the flat
    settings a model also takes, ``flat_settings``)."""
    settings: type | None = model
    for part in loc:
        field = settings.model_fields.get(str(part)) if settings and issubclass(settings, BaseModel) else None
        annotation = field.annotation if field else None
        nested = isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_dataclass(annotation))
        settings = annotation if nested and isinstance(annotation, type) else None
    if settings is not None and is_dataclass(settings):
        return {f.name: f for f in fields(settings)}
    if settings is not None and issubclass(settings, BaseModel):
        return {**settings.model_fields, **getattr(settings, "flat_settings", {})}
    return {}


def explain(error: Mapping[str, Any], flag_names: dict[str, str], model: type[BaseModel] | None = None,
            complete_flags: bool = False) -> tuple[str, str]:
    """One pydantic error as (what is wrong, how to fix it), naming the field and its flag."""
    loc = tuple(error["loc"])
    field = ".".join(str(p) for p in loc) or "config"
    flag = flag_names.get(field) or (None if complete_flags or not loc else "--" + str(loc[-1]).replace("_", "-"))
    name = f"{field} ({flag})" if flag else field
    lead = f"{name}: " if loc else ""  # a check across fields names them in its message
    kind, msg, ctx, given = error["type"], error["msg"], error.get("ctx") or {}, error.get("input")
    if kind in _BOUNDS:
        key, template = _BOUNDS[kind]
        return f"{name}: {msg} (got {given!r})", f"set {name} to {template.format(ctx.get(key))}"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _fields_at(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        where = ".".join(str(p) for p in loc[:-1]) or "the top level"
        fix = (f"did you mean {close[0]!r}? rename or remove it" if close else
               f"remove it; the settings at {where} are {', '.join(sorted(known)) or 'in the docs'}")
        return f"{field}: unknown setting", fix
    if kind.endswith(("_parsing", "_type")) and kind.split("_")[0] in _KINDS:
        expected = _KINDS[kind.split("_")[0]]
        return f"{name}: got {given!r}, which is not {expected}", f"give {name} {expected}"
    if kind in ("literal_error", "enum"):
        return f"{name}: {msg} (got {given!r})", f"set {name} to one of {ctx.get('expected')}"
    if kind == "missing":
        return f"{name}: required", f"set {name}"
    text = msg.removeprefix("Value error, ")
    problem, _, fix = text.partition("; fix: ")
    return f"{lead}{problem}", fix or f"correct {name}"


def flag_names(options: Iterable[str], flat_settings: dict[str, tuple[str, ...]] | None = None) -> dict[str, str]:
    """Setting path -> flag, for a command whose options are named after the settings they set
    (``--batch-size`` sets ``batch_size``, which ``flat_settings`` may place in a section)."""
    where = flat_settings or {}
    return {".".join(where.get(o, (o,))): "--" + o.replace("_", "-") for o in options}


def validation_failure(exc: ValidationError, flag_names: dict[str, str] | None = None,
                       model: type[BaseModel] | None = None, complete_flags: bool = False) -> typer.Exit:
    """One message for a configuration that does not validate: each wrong field with its flag,
    what is wrong and the fix. ``complete_flags``: fields missing from ``flag_names`` have no flag
    (they are set in the config file only)."""
    explained = [explain(e, flag_names or {}, model, complete_flags) for e in exc.errors()]
    if len(explained) == 1:
        return fail(f"invalid configuration:\n  {explained[0][0]}", explained[0][1])
    problems = "".join(f"\n  {problem}\n    fix: {fix}" for problem, fix in explained)
    return fail(f"invalid configuration:{problems}", "correct each value named above")


def emit_results(results: dict, output: Path | None, as_json: bool, show: Callable[[dict], None]) -> None:
    """A benchmark's results: written to ``output`` if given, then printed as JSON or shown."""
    if output:
        output.write_text(json.dumps(results, indent=2))
    if as_json:
        typer.echo(json.dumps(results))
    else:
        show(results)


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


FIXES = {
    "unknown_buffer": "ask about a live buffer (`staleflow buffers` lists them)",
    "upstream_unavailable": "check the job's components with `staleflow status`",
    "invalid_request": "check the flags' values",
}
"""What to do about a refusal, by its error code."""


C = TypeVar("C", bound="Client")
T = TypeVar("T")


def ask(client_class: type[C], url: str, what: str, state_dir: Path, call: Callable[[C], T], timeout: float = 10.0) -> T:
    """``call`` on a client of a running job's service at ``url``; silence or a refusal becomes an
    error message that says the fix."""
    import httpx

    from staleflow.api.base import ServiceError

    try:
        with client_class(url, timeout=timeout, token=job_token(state_dir)) as client:
            return call(client)
    except httpx.TransportError as exc:
        raise fail(f"no {what} answers at {url} ({exc.__class__.__name__}): no job running at {state_dir}?",
                   "start a job with `staleflow up`, or pass --url / --state-dir") from None
    except ServiceError as exc:
        raise fail(f"the {what} at {url} refused: {exc}", FIXES.get(str(exc.body.get("code")))) from None
