"""What Linux's ``/proc`` says about a process's memory."""

from __future__ import annotations

from pathlib import Path


def status_kib(key: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``RssAnon``, ``VmHWM`` ...); None when
    the process is gone, or the field or ``/proc`` does not exist."""
    try:
        with Path(f"/proc/{pid}/status").open() as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
