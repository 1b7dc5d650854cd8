"""The FSDP2 trainer on CUDA (NCCL beside gloo): two steps train with the defaults (bf16,
selective activation checkpointing, chunked or fused log-probs, Liger's layer kernels and packed
rows where available), log-probs in bf16 match the plain formula,
the sharded load reads the saved weights without the whole model on the GPU, a checkpoint
round-trips, and each rank gets its own GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from staleflow.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from staleflow.ports import free_port  # noqa: E402
from staleflow.training.fsdp import FsdpBackend, check_gpus_for_ranks, init_process_group  # noqa: E402
from staleflow.training.logprobs import (  # noqa: E402
    chunk_tokens_for,
    chunked_token_logprobs,
    liger_available,
    liger_token_logprobs,
)

pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.timeout(900)]

PROMPT = int(os.environ.get("STALEFLOW_GPU_TEST_PROMPT", "64"))
RESPONSE = int(os.environ.get("STALEFLOW_GPU_TEST_RESPONSE", "448"))
TRAJECTORIES = int(os.environ.get("STALEFLOW_GPU_TEST_TRAJECTORIES", "8"))


def _batch(vocab: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(TRAJECTORIES):
        n = RESPONSE - (i * 37) % max(RESPONSE // 2, 1)
        trajs.append({"group_id": f"g{i % 2}", "prompt_ids": torch.randint(3, vocab, (PROMPT,), generator=g).tolist(),
                      "tokens": torch.randint(3, vocab, (n,), generator=g).tolist(),
                      "logprobs": (-torch.rand(n, generator=g) * 3).tolist(), "reward": float(i % 3 == 0),
                      "v_traj": 0})
    return {"version": 0, "trajectories": trajs}


def _config(**settings: Any) -> TrainerConfig:
    return TrainerConfig(world_size=1, checkpoint_every=1, algorithm=AlgorithmConfig(lr=1e-4, micro_batch=4), **settings)


@pytest.fixture(scope="module")
def nccl_rank() -> Any:
    init_process_group(0, 1, free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_two_steps_train_on_cuda_with_the_defaults(gpu_model_dir: Path, tmp_path: Path, nccl_rank: None) -> None:
    backend = FsdpBackend(_config(max_tokens_per_micro_batch=4 * (PROMPT + RESPONSE)), gpu_model_dir,
                          tmp_path / "ckpt", 0, 1, final_version=2)
    assert backend.device.type == "cuda" and backend.settings.mixed_precision
    assert backend.settings.activation_checkpointing == "selective"
    vocab = backend.model.config.vocab_size
    torch.cuda.reset_peak_memory_stats()
    first = backend.train(0, _batch(vocab))
    second = backend.train(1, _batch(vocab, seed=1))
    for m in (first, second):
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
        assert m["grad_norm"] > 0 and m["negative_logp"] > 0
    print(f"\ntwo steps: {first['train_seconds']:.2f} s, {second['train_seconds']:.2f} s; micro-batches "
          f"{second['micro_batches']:.0f}; peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; "
          f"fused log-probs {backend.settings.fused_logprobs}; packing {backend.packing}; attention "
          f"{backend.model.config._attn_implementation}")


@pytest.mark.parametrize("tokens", [1, 300, 4096])
def test_log_probs_in_bf16_match_the_plain_formula(tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = (torch.randn(151_936, 512, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    targets = torch.randint(0, 151_936, (tokens,), device="cuda", generator=g)
    upstream = torch.randn(tokens, device="cuda", generator=g)

    def plain(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((h @ w.t()).float(), -1).gather(-1, targets[:, None]).squeeze(-1)

    auto_chunk = chunk_tokens_for(151_936, device=torch.device("cuda"))
    paths = {"chunked": lambda h, w: chunked_token_logprobs(h, w, targets, 64),  # bf16 GEMMs, fp32 outputs
             "chunked, auto chunk": lambda h, w: chunked_token_logprobs(h, w, targets, auto_chunk),
             "chunked, fp32 GEMMs": lambda h, w: chunked_token_logprobs(h, w, targets, 64, fp32_gemm=False)}
    if liger_available(torch.device("cuda")):
        paths["liger"] = lambda h, w: liger_token_logprobs(h, w, targets)
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = plain(h0, w0)
    (expected * upstream).sum().backward()
    for name, fn in paths.items():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got = fn(h, w)
        (got * upstream).sum().backward()
        assert torch.allclose(got, expected, atol=2e-2, rtol=1e-2), name
        for a, b in ((h.grad, h0.grad), (w.grad, w0.grad)):
            assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm() + 1e-3, name


def test_the_sharded_load_reads_the_saved_weights_within_one_shard(gpu_model_dir: Path, tmp_path: Path,
                                                                    nccl_rank: None) -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    backend = FsdpBackend(_config(), gpu_model_dir, tmp_path / "ckpt", 0, 1, final_version=1)
    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    largest = max(p.numel() * 4 for p in backend.model.parameters())
    assert torch.cuda.max_memory_allocated() - start <= params + largest + (64 << 20)  # the shard plus one tensor
    saved = transformers.AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).state_dict()
    for name, value in backend.model.state_dict().items():
        assert torch.equal(value.full_tensor().cpu(), saved[name]), name


def test_a_checkpoint_round_trips(gpu_model_dir: Path, tmp_path: Path, nccl_rank: None) -> None:
    backend = FsdpBackend(_config(), gpu_model_dir, tmp_path / "ckpt", 0, 1, final_version=1)
    backend.train(0, _batch(backend.model.config.vocab_size))
    assert backend.checkpoint(1)
    trained = {k: v.full_tensor().cpu() for k, v in backend.model.state_dict().items()}
    resumed = FsdpBackend(_config(), gpu_model_dir, tmp_path / "ckpt", 0, 1, final_version=2)
    assert resumed.resume_version() == 1
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value.full_tensor().cpu(), trained[name]), name


def test_the_export_is_the_engines_dtype_in_pinned_buffers_and_the_next_step_leaves_it_whole(
        gpu_model_dir: Path, tmp_path: Path, nccl_rank: None) -> None:
    backend = FsdpBackend(_config(export_dtype="bfloat16"), gpu_model_dir, tmp_path / "ckpt", 0, 1, final_version=3)
    vocab = backend.model.config.vocab_size
    backend.train(0, _batch(vocab))
    exported = {k: v.full_tensor().to(torch.bfloat16).cpu() for k, v in backend.model.state_dict().items()}
    share = backend.weights(1)  # copies on a side stream; the next step runs while they are in flight
    backend.train(1, _batch(vocab, seed=1))
    assert share.ready is not None
    share.ready()
    assert {p.name for p in share.pieces} == set(exported) - ({"lm_head.weight"} if backend.tied else set())
    for piece in share.pieces:
        assert piece.data.is_pinned() and piece.data.dtype == torch.bfloat16, piece.name
        assert torch.equal(piece.data, exported[piece.name]), f"{piece.name}: the next step wrote into the export"
    trained = {k: v.full_tensor().to(torch.bfloat16).cpu() for k, v in backend.model.state_dict().items()}
    assert any(not torch.equal(trained[k], exported[k]) for k in exported), "the second step changed nothing"
    assert share.tensors[share.pieces[0].name][0] == "BF16"


def _which_gpu(rank: int, world: int, port: int, out: str) -> None:
    init_process_group(rank, world, port)
    try:
        seen = torch.zeros(world, dtype=torch.long, device="cuda")
        seen[rank] = torch.cuda.current_device()
        dist.all_reduce(seen)
        if rank == 0:
            torch.save(seen.cpu(), out)
    finally:
        dist.destroy_process_group()


def test_one_rank_per_gpu(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    out = tmp_path / "gpus.pt"
    mp.start_processes(_which_gpu, args=(gpus, free_port(), str(out)), nprocs=gpus, start_method="spawn")
    assert torch.load(out).tolist() == list(range(gpus))
    with pytest.raises(ValueError, match=f"{gpus + 1} trainer ranks on this node but only {gpus} GPUs"):
        check_gpus_for_ranks(gpus + 1)
