"""What this machine has: free memory (Linux ``/proc/meminfo``), a process's memory
(``/proc/<pid>/status``) and whether torch sees a GPU."""

from __future__ import annotations

from pathlib import Path


def meminfo_bytes(key: str) -> int | None:
    """A ``/proc/meminfo`` entry (``MemAvailable``, ``MemTotal``...) in bytes; None where it cannot
    be read (not Linux) or the kernel does not report it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def status_kib(key: str, pid: int | str = "self") -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``RssAnon``, ``VmHWM`` ...); None when
    the process is gone, or the field or ``/proc`` does not exist."""
    try:
        with Path(f"/proc/{pid}/status").open() as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
