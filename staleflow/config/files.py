"""A job file's settings: YAML, TOML or JSON, read into the mapping ``JobConfig`` validates."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml


class SettingsFileError(ValueError):
    """A settings file that is missing, unreadable, of an unknown kind or not a mapping."""


def read_settings_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SettingsFileError(f"config file {path} does not exist")
    if path.suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise SettingsFileError(f"config file {path}: use .yaml, .toml or .json")
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SettingsFileError(f"config file {path} is not valid: {exc}") from None
    except OSError as exc:
        raise SettingsFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise SettingsFileError(f"config file {path} must hold a mapping of settings")
    return data
