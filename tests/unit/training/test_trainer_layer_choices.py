"""The trainer's layer settings resolved per device (Liger kernels never on the CPU, selective
checkpointing by default on CUDA, packing through the registered varlen attention), the varlen
adapter against the three signatures torch's ``varlen_attn`` has had, the packed attention's CPU
path against padded attention, and bad values refused with the fix."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

from pydantic import ValidationError  # noqa: E402

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.training import attention, layers  # noqa: E402
from staleflow.training.attention import PACKED_ATTENTION, packed_attention, packing_for, varlen_causal  # noqa: E402
from staleflow.training.fsdp import resolve_settings  # noqa: E402
from staleflow.training.layers import checkpointing_for, fused_kernels_for  # noqa: E402

pytestmark = pytest.mark.torch

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


@pytest.fixture
def liger_stub(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """An importable ``liger_kernel.transformers`` with a Qwen2 patch that records its calls."""
    calls: list[dict[str, Any]] = []

    def apply_liger_kernel_to_qwen2(rope: bool = True, cross_entropy: bool = False,
                                    fused_linear_cross_entropy: bool = True, rms_norm: bool = True,
                                    swiglu: bool = True, model: Any = None) -> None:
        calls.append({"rope": rope, "cross_entropy": cross_entropy, "fused_linear_cross_entropy": fused_linear_cross_entropy,
                      "rms_norm": rms_norm, "swiglu": swiglu, "model": model})

    package = types.ModuleType("liger_kernel")
    module = types.ModuleType("liger_kernel.transformers")
    module.apply_liger_kernel_to_qwen2 = apply_liger_kernel_to_qwen2  # type: ignore[attr-defined]
    package.transformers = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return calls


def test_liger_layer_kernels_are_never_chosen_on_the_cpu(liger_stub: list[dict[str, Any]]) -> None:
    assert layers.liger_layers_available(CUDA) and not layers.liger_layers_available(CPU)
    assert fused_kernels_for("auto", CUDA, "qwen2", compiled=False)
    assert not fused_kernels_for("auto", CPU, "qwen2", compiled=False)
    assert not fused_kernels_for("auto", CUDA, "qwen2", compiled=True)  # inductor fuses the same ops
    assert not fused_kernels_for("auto", CUDA, "gpt_bigcode", compiled=False)  # no Liger patch for the type
    assert not fused_kernels_for(False, CUDA, "qwen2", compiled=False)
    with pytest.raises(ValueError, match=r"fused_kernels: true needs CUDA and liger_kernel .*auto or false"):
        fused_kernels_for(True, CPU, "qwen2", compiled=False)


def test_fused_kernels_true_without_liger_is_refused_before_a_model_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(ValueError, match=r"pip install 'staleflow\[liger\]'"):
        resolve_settings(TrainerConfig(fused_kernels=True), CUDA)
    assert not fused_kernels_for("auto", CUDA, "qwen2", compiled=False)


def test_liger_is_asked_for_layer_kernels_only(liger_stub: list[dict[str, Any]]) -> None:
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    layers.apply_liger_layers(model)
    assert liger_stub == [{"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True,
                           "swiglu": True, "model": model}]


def test_checkpointing_auto_is_selective_on_cuda_and_off_on_the_cpu() -> None:
    assert checkpointing_for("auto", CUDA) == "selective"
    assert checkpointing_for("auto", CPU) == "none"
    assert [checkpointing_for(v, CPU) for v in (True, False, "selective")] == ["full", "none", "selective"]
    assert resolve_settings(TrainerConfig(), CPU).activation_checkpointing == "none"
    assert resolve_settings(TrainerConfig(activation_checkpointing="selective"), CPU).activation_checkpointing == "selective"


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("activation_checkpointing", "partial", "activation_checkpointing"),
    ("fused_kernels", "yes please", "fused_kernels"),
    ("compile", "auto", "compile"),
    ("packing", "varlen", "packing"),
])
def test_a_bad_layer_setting_is_refused_naming_it(setting: str, value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainerConfig(**{setting: value})


def _tiny(attn: str = "sdpa") -> Any:
    config = transformers.Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def test_packing_auto_turns_on_with_cuda_and_varlen_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not packing_for(_tiny(), "auto", CPU)
    model = _tiny()
    assert packing_for(model, "auto", CUDA) and model.config._attn_implementation == PACKED_ATTENTION
    monkeypatch.setattr(attention, "torch_varlen_attn", lambda: None)  # a torch before 2.10
    assert not packing_for(_tiny(), "auto", CUDA)
    with pytest.raises(ValueError, match=r"needs torch's varlen attention \(torch >= 2.10"):
        packing_for(_tiny(), True, CUDA)
    model = _tiny()
    assert packing_for(model, True, CPU) and model.config._attn_implementation == PACKED_ATTENTION  # the CPU fallback
    assert not packing_for(_tiny(), False, CUDA)


def test_packing_true_on_attention_that_cannot_take_packed_rows_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny()
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    with pytest.raises(ValueError, match=r"cannot take packed rows .*set packing to auto or false"):
        packing_for(model, True, CPU)
    assert not packing_for(model, "auto", CPU)


class FakeVarlen:
    """``varlen_attn`` with one torch version's signature: records the keywords it was given."""

    def __init__(self, version: str):
        self.seen: dict[str, Any] = {}
        signatures = {
            "2.10": lambda q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None: None,
            "2.11": lambda q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1): None,
            "2.13": lambda q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None: None,
        }
        self.__signature__ = __import__("inspect").signature(signatures[version])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen = {"q": q, "k": k, "v": v, "args": args, **kwargs}
        return q


@pytest.mark.parametrize(("version", "expected"), [
    ("2.10", {"is_causal": True}),
    ("2.11", {"window_size": (-1, 0), "scale": 0.25}),
    ("2.13", {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.25}),
])
def test_the_varlen_adapter_asks_each_version_for_causal_gqa_attention(version: str, expected: dict[str, Any]) -> None:
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    fake = FakeVarlen(version)
    varlen_causal(q, k, k, cu, cu, 4, 4, scale=0.25, varlen=fake)
    assert {key: fake.seen[key] for key in fake.seen if key not in ("q", "k", "v", "args")} == expected
    assert fake.seen["args"] == (cu, cu, 4, 4)
    if version == "2.10":  # no scale and no GQA there: folded into the queries, K/V repeated to the query heads
        assert torch.equal(fake.seen["k"], k.repeat_interleave(2, dim=1))
        assert torch.allclose(fake.seen["q"], q * (0.25 * 16 ** 0.5))
    else:
        assert fake.seen["k"] is k and fake.seen["q"] is q


def test_packed_cpu_attention_equals_padded_causal_attention() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 8, 3]
    q = torch.randn(1, 4, sum(lengths), 8, generator=g)
    k, v = torch.randn(1, 2, sum(lengths), 8, generator=g), torch.randn(1, 2, sum(lengths), 8, generator=g)
    out, _ = packed_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, **attention.packed_inputs(lengths))
    assert out.shape == (1, sum(lengths), 4, 8)
    start = 0
    for n in lengths:
        alone, _ = packed_attention(torch.nn.Module(), q[:, :, start:start + n], k[:, :, start:start + n],
                                    v[:, :, start:start + n], None, scaling=0.3)
        torch.testing.assert_close(out[:, start:start + n], alone)
        start += n
