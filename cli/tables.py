"""Tables that fit the terminal: headers are never cut mid-word, and what a component's health says
comes down to one line (``headline``) unless asked for all of it."""

from __future__ import annotations

from typing import Any

from rich.table import Column, Table

from staleflow.cli.common import readable

WIDE = 100  # terminals at least this wide get the extra columns without --verbose


def fitted_table(title: str | None, *headers: str, wrap: tuple[str, ...] = ()) -> Table:
    """A table whose columns are never narrower than their header's longest word, so a narrow
    terminal wraps a header between words instead of cutting it ("insta…"). Cells of the ``wrap``
    columns wrap between words; the others never wrap nor get cut (the id and number columns)."""
    columns = [Column(h, min_width=max(map(len, h.split())), overflow="fold",
                      no_wrap=h not in wrap) for h in headers]
    # at least as wide as the title, so a long title (a path) is not broken up inside a narrow table
    return Table(*columns, title=title, min_width=len(title) if title else None)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _trajectory_server(health: dict[str, Any]) -> str:
    counts = health.get("counts") or {}
    parts = [f"{counts.get('routed', 0)} routed", f"{counts.get('pending', 0)} pending"]
    skipped = (health.get("skipped_prompts") or {}).get("count")
    if skipped:
        parts.append(f"{_plural(skipped, 'prompt')} skipped")
    regenerated = (health.get("progress") or {}).get("regenerated_tokens")
    if regenerated:
        parts.append(f"{regenerated} tokens regenerated")
    return ", ".join(parts)


def _instance(health: dict[str, Any]) -> str:
    outbox = health.get("outbox") or {}
    parts = [f"{health.get('engine', '?')} engine", f"{outbox.get('last_seq', 0)} completions"]
    if outbox.get("pending"):
        parts.append(f"{outbox['pending']} undelivered")
    if outbox.get("dropped"):
        parts.append(f"{outbox['dropped']} dropped")
    return ", ".join(parts)


def _reward(health: dict[str, Any]) -> str:
    parts = [_plural(health.get("workers", 0), "worker")]
    if health.get("replaced_workers"):
        parts.append(f"{health['replaced_workers']} replaced")
    timeouts = sum((health.get("timeouts") or {}).values())
    if timeouts:
        parts.append(_plural(timeouts, "timeout"))
    return ", ".join(parts)


def headline(health: dict[str, Any] | None) -> str:
    """A component's health in a few words: its one or two numbers that matter, and anything that
    needs acting on (skipped prompts, undelivered completions, replaced workers)."""
    if not health:
        return "does not answer"
    if "train_version" in health:
        return f"train version {health['train_version']}"
    if "latest" in health:
        latest = "nothing published" if health["latest"] is None else f"version {health['latest']} latest"
        return f"{latest}, {health.get('versions', 0)} kept"
    if "counts" in health:
        return _trajectory_server(health)
    if "instance_id" in health:
        return _instance(health)
    if "workers" in health:
        return _reward(health)
    if "cycles" in health:
        return _plural(health["cycles"], "cycle")
    rest = [f"{key} {readable(value)}" for key, value in health.items() if key != "status"]
    return ", ".join(rest[:2])
