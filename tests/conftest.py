from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support import manager_config

from staleflow.servers.clients import ManagerClient
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app


TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ runs whole jobs: it is marked ``slow``, so ``-m "not slow"`` is
    the fast tier (tests/unit and tests/integration)."""
    for item in items:
        if (TESTS / "e2e") in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ManagerClient]:
    """A staleness manager on a loopback port, with a client."""
    with serve_in_thread(create_app(manager_config(tmp_path))) as server, ManagerClient(server.url) as client:
        client.health()
        yield client


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without $STALEFLOW_TOKEN; tests that want one set it themselves."""
    monkeypatch.delenv("STALEFLOW_TOKEN", raising=False)
