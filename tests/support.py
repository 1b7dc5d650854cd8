"""Helpers shared by the tests (the tests folder is on sys.path under pytest)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

from staleflow.config import LedgerConfig, ManagerConfig


def manager_config(tmp_path: Path, db_url: str | None = None, **ledger: object) -> ManagerConfig:
    return ManagerConfig(ledger=LedgerConfig(**{"eta": 1, "batch_size": 2, "group_size": 1, **ledger}),
                         state_dir=tmp_path, db_url=db_url, port=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(*args: str) -> subprocess.Popen:
    """Run ``staleflow ARGS`` as its own process; return once its socket listens (the log line
    comes after the bind, and requests queue in the backlog until the app serves them)."""
    proc = subprocess.Popen([sys.executable, "-m", "staleflow.cli", *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "listening on" in line:
            break
    else:
        raise AssertionError(f"`staleflow {' '.join(args)}` exited with {proc.wait()}:\n{''.join(seen[-20:])}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining the pipe
    return proc
