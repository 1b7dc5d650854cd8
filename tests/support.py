"""Helpers shared by the tests (the tests folder is on sys.path under pytest)."""

from __future__ import annotations

import socket
from pathlib import Path

from staleflow.config import LedgerConfig, ManagerConfig


def manager_config(tmp_path: Path, **ledger: object) -> ManagerConfig:
    return ManagerConfig(ledger=LedgerConfig(**{"eta": 1, "batch_size": 2, "group_size": 1, **ledger}),
                         state_dir=tmp_path, port=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
