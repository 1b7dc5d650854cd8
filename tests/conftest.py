from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import manager_config, wheel_in_fresh_venv

from staleflow.api.manager import ManagerClient
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app

TESTS = Path(__file__).parent

# pytest-xdist's workers start with COLUMNS=80 set, and a rich Console made while it is set keeps
# that width for good: the CLI's console (made at import) would then ignore the widths the CLI
# tests give each command
os.environ.pop("COLUMNS", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ runs whole jobs: it is marked ``slow``, so ``-m "not slow"`` is
    the fast tier (tests/unit and tests/integration)."""
    for item in items:
        if (TESTS / "e2e") in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[object]:
    """A throwaway PostgreSQL server for the whole session, started on first use and stopped at the
    end (``throwaway_postgres``); skipped, saying why, only where no server binary or driver exists."""
    yield from _throwaway_postgres()


@pytest.fixture
def own_postgres() -> Iterator[object]:
    """A throwaway PostgreSQL server of one test's own, which it may stop (``halt``, an outage)
    and start again (``resume``); skipped like ``postgres_server`` where none can run."""
    yield from _throwaway_postgres()


def _throwaway_postgres() -> Iterator[object]:
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("the psycopg driver is not installed (pip install 'staleflow[postgres]')")
    from support.throwaway_postgres import ThrowawayPostgres, find_binaries

    binaries = find_binaries()
    if binaries is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH, in $POSTGRES_BIN "
                    "or in /usr/lib/postgresql/*/bin")
    server = ThrowawayPostgres(binaries)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """StaleFlow's wheel installed into a fresh virtual environment (``wheel_in_fresh_venv``): its
    python and the folder the wheel went into. Built once for every test that installs it."""
    return wheel_in_fresh_venv(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The durable state's database, once per backend: None means the default (SQLite files in the
    state directory); on PostgreSQL a fresh database of the session's server, dropped afterwards."""
    if request.param == "sqlite":
        yield None
        return
    server = request.getfixturevalue("postgres_server")
    url = server.create_database()
    try:
        yield url
    finally:
        server.drop_database(url)


@pytest.fixture
def manager(tmp_path: Path, db_url: str | None) -> Iterator[ManagerClient]:
    """A staleness manager on a loopback port, with a client (on each database backend)."""
    config = manager_config(tmp_path).model_copy(update={"db_url": db_url})
    with serve_in_thread(create_app(config)) as server, ManagerClient(server.url) as client:
        client.health()
        yield client


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without $STALEFLOW_TOKEN(_FILE); tests that want one set it themselves."""
    monkeypatch.delenv("STALEFLOW_TOKEN", raising=False)
    monkeypatch.delenv("STALEFLOW_TOKEN_FILE", raising=False)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """The raw sockets a test opens (``support.sockets.connect``), closed when it ends."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()
