"""A trainer step's transient blocks (a batch's reply, its text, its parsed lists) are freed
between live ones; the trainer loop hands their pages back after each step, or the process keeps
its largest step's worth of free heap resident."""

from __future__ import annotations

import sys

import pytest

from staleflow.host import release_freed_heap, status_kib

BLOCK = 16 * 1024  # above Python's small-object limit, below glibc's mmap threshold: the C heap
BLOCKS = 4096  # 64 MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and malloc_trim are Linux/glibc")
def test_free_pages_between_live_blocks_go_back():
    blocks = [bytearray(BLOCK) for _ in range(BLOCKS)]  # bytearray(n) writes its zeros: resident
    kept = blocks[::16]  # one live block in sixteen: the heap cannot shrink from its top
    del blocks
    held = status_kib("VmRSS")
    release_freed_heap()
    released = held - status_kib("VmRSS")
    freed_kib = BLOCK * BLOCKS * 15 // 16 // 1024
    assert released > freed_kib // 2, f"released {released} KiB of {freed_kib} KiB freed"
    assert len(kept) == BLOCKS // 16
