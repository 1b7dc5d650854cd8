"""What this machine has: free memory (Linux ``/proc/meminfo``), a process's memory
(``/proc/<pid>/status``), giving the C heap's free pages back, and whether torch sees a GPU."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where
    the C library has none). glibc keeps what was freed below its mmap threshold, which it raises
    (up to 32 MiB) as large blocks are freed, so a process whose transient peaks vary (a pulled
    model's layers, a trainer's batches of different sizes) keeps the highest peak it has seen
    resident, in pieces between live blocks: a vLLM engine grew by about one model during a pull
    (183 MiB on a 188 MiB model), the simulated trainer of the default sim job by 60 MiB of free
    heap over 80 steps (docs/faults.md, memory that stays flat)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
