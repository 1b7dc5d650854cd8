"""The layer settings on CUDA: Liger's layer kernels give the unpatched layers' outputs and
gradients (bf16 tolerance) under the same parameter names; packed rows through torch's varlen
attention train what padded rows train; selective checkpointing and compiled layers train what
the plain layers train."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from test_trainer_on_cuda import _batch, _config, free_port  # noqa: E402

from staleflow.training.attention import PACKED_ATTENTION, torch_varlen_attn  # noqa: E402
from staleflow.training.fsdp import FsdpBackend, init_process_group  # noqa: E402
from staleflow.training.layers import apply_liger_layers, liger_layers_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.torch, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def nccl_rank() -> Iterator[None]:
    init_process_group(0, 1, free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-6))


def test_liger_layers_match_the_unpatched_layers_and_keep_their_names() -> None:
    if not liger_layers_available(torch.device("cuda")):
        pytest.skip("liger_kernel is not installed (../shared/tools/gpu-wheelhouse DIR liger-kernel==0.8.5)")
    config = transformers.Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 1024, (2, 300), device="cuda")

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    names, plain_norm = list(model.state_dict()), type(model.model.norm).forward
    plain_logits, plain_grads = run()  # before the patch: its RoPE swap is process-wide
    apply_liger_layers(model)
    assert model.model.norm.forward.__func__ is not plain_norm  # Liger's forward, bound onto the instance
    liger_logits, liger_grads = run()
    assert list(model.state_dict()) == names
    assert _relative(liger_logits, plain_logits) < 2e-2
    for name, grad in plain_grads.items():
        assert _relative(liger_grads[name], grad) < 5e-2, name


def _train(gpu_model_dir: Path, tmp_path: Path, **settings: Any) -> tuple[FsdpBackend, dict[str, float]]:
    backend = FsdpBackend(_config(max_tokens_per_micro_batch=4096, **settings), gpu_model_dir, tmp_path / "ckpt", 0, 1,
                          final_version=2)
    return backend, backend.train(0, _batch(backend.model.config.vocab_size))


@pytest.mark.parametrize("settings", [{"packing": True}, {"activation_checkpointing": "selective"}, {"compile": True}],
                         ids=["packed", "selective", "compiled"])
def test_each_layer_setting_trains_what_the_plain_layers_train(gpu_model_dir: Path, tmp_path: Path, nccl_rank: None,
                                                               settings: dict[str, Any]) -> None:
    if settings.get("packing") and torch_varlen_attn() is None:
        pytest.skip("torch.nn.attention.varlen needs torch >= 2.10")
    plain_settings = {"packing": False, "activation_checkpointing": False, "compile": False, "fused_kernels": False}
    _, plain = _train(gpu_model_dir, tmp_path / "plain", **plain_settings)
    backend, tried = _train(gpu_model_dir, tmp_path / "tried", **{**plain_settings, **settings})
    if settings.get("packing"):
        assert backend.packing and backend.model.config._attn_implementation == PACKED_ATTENTION
    for key in ("loss", "negative_logp", "grad_norm"):
        assert tried[key] == pytest.approx(plain[key], rel=3e-2, abs=1e-3), (key, tried, plain)
