"""Fixtures of the trainer's integration tests: a tiny untied Qwen2 on disk, and one gloo rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import free_port, save_tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), tied=False)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A process group of one gloo rank for the module's tests (torch imported here, not at collection)."""
    import torch.distributed as dist

    from staleflow.training.fsdp import init_process_group

    init_process_group(0, 1, free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()
