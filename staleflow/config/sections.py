"""How a job file's values reach their sections: flat settings (``routing: vanilla`` for
``coordinator: {strategy: {routing: vanilla}}``) and presets merged section by section."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from pydantic import BaseModel

from staleflow.config.coordinator import STRATEGY_FIELDS

FLAT_SETTINGS: dict[str, tuple[str, ...]] = {
    **{name: ("ledger", name) for name in ("eta", "batch_size", "group_size")},
    "trainer_ranks": ("trainer", "world_size"),
    **{name: ("coordinator", "strategy", name) for name in sorted(STRATEGY_FIELDS)},
    "cycle_period": ("coordinator", "cycle_period"),
    "calibration": ("coordinator", "calibration"),
    "max_tokens": ("trajectories", "sampling", "max_tokens"),
    "progress_tokens": ("instance", "progress_tokens"),
}
"""Settings a job may give flat (``routing: vanilla``, ``--routing vanilla``): where each one goes."""


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, section by section (a partial section keeps the base's others)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def nested(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its flat settings (``FLAT_SETTINGS``) moved into their sections."""
    out = {k: v for k, v in data.items() if k not in FLAT_SETTINGS}
    for name, path in FLAT_SETTINGS.items():
        if name not in data:
            continue
        section = out
        for part in path[:-1]:
            inner = _fields_of(section.get(part, {}))
            if inner is None:  # a section given as something else: validation names it
                break
            section[part] = section = inner
        else:
            section[path[-1]] = data[name]
    return out


def _fields_of(section: Any) -> dict[str, Any] | None:
    """A section's settings as a new dict (from a dict, a model or a dataclass); None for anything else."""
    if isinstance(section, dict):
        return dict(section)
    if isinstance(section, BaseModel):
        return dict(section)
    if is_dataclass(section) and not isinstance(section, type):
        return {f.name: getattr(section, f.name) for f in fields(section)}
    return None


def flat_setting(*path: str) -> property:
    """A read-only attribute for a flat setting: the value at ``path`` in its section."""

    def read(self: Any) -> Any:
        value: Any = self
        for part in path:
            value = getattr(value, part)
        return value

    return property(read, doc=f"the job's {'.'.join(path)}")
