"""The layer contracts (checked by `.ci/lint-imports`) name every module of the library."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _contract(name_start: str) -> dict:
    return next(c for c in _contracts() if c["name"].startswith(name_start))


def _library_on_disk() -> set[str]:
    return {f"staleflow.{p.stem}" for p in (ROOT / "staleflow").iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}


def test_the_library_contract_lists_every_library_module() -> None:
    library = _contract("The library never imports")
    assert set(library["source_modules"]) == _library_on_disk(), (
        "add the new library module to the first contract in pyproject.toml [tool.importlinter]")


def test_the_config_contracts_place_every_library_module_above_or_below_the_config() -> None:
    """A library module is either a leaf (the config may import it; it imports nothing of the
    library) or above the config (the config may not import it)."""
    leaves = set(_contract("The leaf modules import nothing")["source_modules"])
    above = set(_contract("The config imports nothing")["forbidden_modules"])
    assert not leaves & above, f"both a leaf and above the config: {sorted(leaves & above)}"
    unplaced = _library_on_disk() - {"staleflow.config"} - leaves - above
    assert not unplaced, (f"{sorted(unplaced)}: add it to the config contract's forbidden_modules in pyproject.toml "
                          "[tool.importlinter] (or, if it imports nothing of staleflow, to the leaf modules)")
    leaf_forbidden = set(_contract("The leaf modules import nothing")["forbidden_modules"])
    assert leaf_forbidden == _library_on_disk() - leaves, "the leaf modules may import no other library module"
