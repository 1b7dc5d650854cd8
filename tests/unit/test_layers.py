"""The layer contracts (checked by `.ci/lint-imports`) name every module of the library."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_library_contract_lists_every_library_module() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    library = next(c for c in contracts if c["name"].startswith("The library never imports"))
    on_disk = {f"staleflow.{p.stem}" for p in (ROOT / "staleflow").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert set(library["source_modules"]) == on_disk, (
        "add the new library module to the first contract in pyproject.toml [tool.importlinter]")
