"""A tensor-parallel vLLM worker's pull from a real parameter server: each tensor of the
version arrives cut to the part the worker asked for, window by window, verified."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.vllm_worker import pull_windows, windowed_pull  # noqa: E402
from staleflow.servers.http import serve_in_thread  # noqa: E402
from staleflow.servers.params import ParamsConfig, create_app  # noqa: E402
from staleflow.transports.client import ParamsClient  # noqa: E402
from staleflow.transports.selection import TensorSlice  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    config = ParamsConfig(state_dir=tmp_path, port=0, chunk_bytes=4 << 10, fsync=False, keep=2,
                          transports=("http", "shm"))
    with serve_in_thread(create_app(config)) as server:
        yield server.url


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"layers.0.q_proj.weight": torch.randn(64, 32, generator=generator),
            "layers.0.q_proj.bias": torch.randn(64, generator=generator),
            "layers.0.o_proj.weight": torch.randn(32, 64, generator=generator),
            "layers.0.norm.weight": torch.randn(32, generator=generator),
            "embed.weight": torch.randn(50, 32, generator=generator).to(torch.bfloat16)}


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_each_tensor_arrives_cut_to_its_part_in_windows(url: str, transport: str) -> None:
    state = weights()
    with ParamsClient(url) as params:
        params.push(1, state)
        for rank in range(2):
            parts = {"layers.0.q_proj.weight": TensorSlice(0, rank, 2), "layers.0.q_proj.bias": TensorSlice(0, rank, 2),
                     "layers.0.o_proj.weight": TensorSlice(1, rank, 2)}
            lease = params.open_pull(1, transport)
            try:
                # small windows: more of them than when each tensor is pulled whole would need bytes for
                windows = pull_windows(lease.manifest.tensors, 6 << 10, parts)
                assert len(windows) < len(pull_windows(lease.manifest.tensors, 6 << 10))
                got = dict(windowed_pull(params, lease, 6 << 10, parts))
            finally:
                params.close_pull(lease)
            assert got.keys() == state.keys()
            for name, tensor in state.items():
                part = parts.get(name)
                want = tensor if part is None else tensor.tensor_split(part.count, part.dim)[part.index]
                assert got[name].dtype == want.dtype and torch.equal(got[name], want), (rank, name)
