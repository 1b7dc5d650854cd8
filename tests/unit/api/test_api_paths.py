"""Outside the services' contracts (``staleflow.api``) no code spells a service's paths: every
caller goes through the typed clients, and every service registers its handlers from the same
declarations (``@handles(app, ManagerRoutes.reserve)``), so a route is declared once. A scan of the
source for string literals that are (or contain, after an interpolation) a ``/v1/`` path enforces it;
a service's own ``@app.get("/v1/...")`` counts as one.

Allowed: prose (docstrings, descriptions that mention a path mid-sentence), and the tests of a
service's own HTTP API (they test the server, so they post raw paths)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCANNED = ["coordinator", "cli", "launch", "servers", "staleflow"]  # and the tests' shared helpers (below):
# support modules and conftest files; standalone scripts that drive one service (e2e probes) test its API
CONTRACTS = ROOT / "staleflow" / "api"
ALLOWED = {
    # the config composes the instances' callback addresses from the trajectory server's URL; the
    # config sits below the contracts (they import it), so it cannot call Route.url
    "staleflow/config/compose.py": 2,
}


def raw_paths(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each string in ``source`` that spells a ``/v1/`` path: a literal starting
    with it, or an f-string with a literal part starting with it."""
    tree = ast.parse(source)
    found = []
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [p.value for p in node.values if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            if any(part.startswith("/v1/") for part in parts):
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings
              and node.value.startswith("/v1/")):
            found.append((node.lineno, node.value))
    return sorted(found)


def _scanned_files() -> list[Path]:
    files = [f for entry in SCANNED for f in sorted((ROOT / entry).rglob("*.py")) if CONTRACTS not in f.parents]
    helpers = [f for f in sorted((ROOT / "tests").rglob("*.py")) if f.stem == "conftest" or "support" in f.relative_to(ROOT).parts]
    return files + helpers


def test_no_code_outside_the_contracts_builds_a_service_path() -> None:
    offenders = []
    for path in _scanned_files():
        name = path.relative_to(ROOT).as_posix()
        found = raw_paths(path.read_text())
        if len(found) != ALLOWED.get(name, 0):
            offenders += [f"{name}:{line}: {text}" for line, text in found]
    assert not offenders, ("call the service's typed client (staleflow.api.<service>), or serve its declaration "
                           "(servers.http.handles), instead of spelling its paths:\n" + "\n".join(offenders))


def test_the_scan_finds_raw_paths_in_calls_and_route_decorators_and_leaves_prose() -> None:
    source = '''
"""Reads ``/v1/health`` and GET /v1/buffers, in prose."""
@app.get("/v1/buffers/{version}", response_model=BufferOut)
def buffer(version: int) -> dict:
    """The buffer (see ``/v1/buffers``)."""
    return {}

def caller(client, ts, version, url):
    client.get("/v1/buffers")
    ts.delete(f"/v1/batches/{version}")
    callback = f"{url}/v1/completed"
    described = Field(description="the trajectory server's /v1/progress")
'''
    assert [line for line, _ in raw_paths(source)] == [3, 9, 10, 11]


def test_the_scan_covers_every_caller_folder() -> None:
    names = {p.relative_to(ROOT).parts[0] for p in _scanned_files()}
    assert {"coordinator", "cli", "launch", "servers", "staleflow", "tests"} <= names
    assert ROOT / "tests" / "support" / "__init__.py" in _scanned_files() and ROOT / "tests" / "conftest.py" in _scanned_files()
    assert not any(CONTRACTS in p.parents for p in _scanned_files())
