"""One owner per state directory: the ``staleflow up`` (or soak) that runs a job holds an exclusive
``flock`` on ``<state dir>/up.lock``, which holds its pid, from before anything in the directory is
deleted or started until the job has shut down. The kernel drops the lock when the process dies,
however it dies, so a crashed run never leaves the directory locked.

``take_state_dir`` is how every launcher opens its run's directory: the lock first, then the rules
of a fresh, resumed or new run."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from staleflow.config import JobConfig

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


def take_state_dir(config: JobConfig, resume: bool, fresh: bool) -> StateDirLock:
    """Take the state directory's lock first (a live job's directory is refused, untouched), then
    apply the rules of a fresh, resumed or new run; the lock is released if they refuse."""
    lock = StateDirLock(config.state_dir)
    try:
        _apply_state_rules(config, resume, fresh)
    except BaseException:
        lock.release()
        raise
    return lock


def _apply_state_rules(config: JobConfig, resume: bool, fresh: bool) -> None:
    state = config.state_dir
    previous = state / "job.json"
    replaced = previous.exists() and not resume  # a finished run, or an unfinished one with --fresh
    if previous.exists() and not resume:
        finished = (state / "report" / "summary.json").exists()
        if not (fresh or finished):
            raise StateDirInUse(
                f"{state} holds an unfinished run; continue it with --resume, or start over with --fresh")
        clear_state_dir(state)
    if (url := config.database_url()) is not None:  # a database that outlives the state directory
        from staleflow.servers.db import prepare_for_run

        prepare_for_run(url, resume, discard=fresh or replaced)
    if resume and previous.exists():
        before = JobConfig.model_validate_json(previous.read_text())
        if before.ledger != config.ledger:
            raise StateDirInUse(f"{state} was created with {before.ledger}; resume needs the same ledger settings")
    state.mkdir(parents=True, exist_ok=True)
    (state / "logs").mkdir(exist_ok=True)
    (state / "job.json").write_text(config.model_dump_json(indent=2))
