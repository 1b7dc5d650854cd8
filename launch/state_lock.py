"""One owner per state directory: the ``staleflow up`` (or soak) that runs a job holds an exclusive
``flock`` on ``<state dir>/up.lock``, which holds its pid, from before anything in the directory is
deleted or started until the job has shut down. The kernel drops the lock when the process dies,
however it dies, so a crashed run never leaves the directory locked."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_FILE = "up.lock"


class StateDirInUse(RuntimeError):
    pass


class StateDirLock:
    """Taken at construction (at once, never waiting); ``release`` gives it up."""

    def __init__(self, state: Path):
        state.mkdir(parents=True, exist_ok=True)
        self.path = state / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirInUse(
                f"{state} belongs to a running job: `staleflow up` pid {holder} holds {self.path}. Nothing was "
                f"changed. Stop that job first (kill {holder}: it stops cleanly and `--resume` continues it), "
                f"or give this one another --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """The file stays: deleting it would let a second owner lock a new file while a third
        still waits on the old one."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def clear_state_dir(state: Path) -> None:
    """Delete everything in ``state`` but its lock file (held by this process)."""
    import shutil

    for entry in state.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
