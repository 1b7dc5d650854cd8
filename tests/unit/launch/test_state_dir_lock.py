"""One owner per state directory: the lock is exclusive, names its holder, survives clearing the
directory for a fresh run, and is free again once released or once its holder is gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from staleflow.launch.state_lock import LOCK_FILE, StateDirInUse, StateDirLock, clear_state_dir


def test_a_second_owner_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    first = StateDirLock(tmp_path / "run")
    with pytest.raises(StateDirInUse, match=rf"pid {os.getpid()}\b.*--state-dir"):
        StateDirLock(tmp_path / "run")
    first.release()
    second = StateDirLock(tmp_path / "run")  # released: free again
    assert second.held
    second.release()


def test_clearing_for_a_fresh_run_keeps_the_held_lock(tmp_path: Path) -> None:
    state = tmp_path / "run"
    lock = StateDirLock(state)
    (state / "logs").mkdir()
    (state / "logs" / "ts.log").write_text("x")
    (state / "job.json").write_text("{}")
    clear_state_dir(state)
    assert [p.name for p in state.iterdir()] == [LOCK_FILE]
    with pytest.raises(StateDirInUse):
        StateDirLock(state)  # still held: the file is the one locked
    lock.release()


def test_a_dead_holder_leaves_the_directory_free(tmp_path: Path) -> None:
    """The kernel drops a killed process's lock: a crashed `up` never blocks the next one."""
    state = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from staleflow.launch.state_lock import StateDirLock; "
                               f"StateDirLock(Path({str(state)!r})); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse, match=rf"pid {holder.pid}\b"):
            StateDirLock(state)
    finally:
        holder.kill()
        holder.wait(30)
    StateDirLock(state).release()
