"""The wheel holds every module: built, installed into a fresh virtual environment outside the
checkout, every module imports and a simulated job runs from it.

The editable install of the README cannot see a package missing from the wheel (its finder maps
``staleflow`` onto the source folder), so this is the guard for the package list in setup.py."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NOT_IMPORTABLE = {"staleflow.cli.__main__", "staleflow.migrations.env"}  # run on import, by design


def folders() -> dict[str, str]:
    """setup.py's folder -> package mapping."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "FOLDERS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no FOLDERS mapping")


def source_modules() -> list[str]:
    """Every module under the mapped folders, by its installed name."""
    modules = []
    for folder, package in folders().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if name not in NOT_IMPORTABLE:
                modules.append(name)
    return modules


def test_every_source_folder_is_a_package() -> None:
    """setup.py finds packages by their ``__init__.py``: a folder of modules without one would be
    left out of the wheel."""
    missing = [str(d.relative_to(ROOT)) for folder in folders() for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert missing == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_installs_imports_every_module_and_runs_a_job(installed_wheel: tuple[Path, str],
                                                                tmp_path: Path) -> None:
    python, site = installed_wheel

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    modules = source_modules()
    check = ("import importlib, sys\n"
             "failed = []\n"
             f"for name in {modules!r}:\n"
             "    try:\n"
             "        module = importlib.import_module(name)\n"
             "    except ModuleNotFoundError as exc:\n"
             "        if (exc.name or '').startswith('staleflow'):\n"
             "            failed.append(f'{name}: {exc}')\n"  # an optional extra that is not installed is fine
             "    except Exception as exc:\n"
             "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
             "    else:\n"
             f"        assert module.__file__.startswith({site!r}), module.__file__\n"
             "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    imported = subprocess.run([python, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stdout + imported.stderr

    staleflow = python.parent / "staleflow"
    job = subprocess.run([staleflow, "up", "--engine", "sim", "--steps", "2", "--state-dir", str(tmp_path / "run"),
                          "--workload", "ci-tiny", "--max-tokens", "48", "--instances", "2", "--batch-size", "4",
                          "--group-size", "2", "--eta", "1", "--speed", "20"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert (tmp_path / "run" / "report" / "summary.json").exists()
