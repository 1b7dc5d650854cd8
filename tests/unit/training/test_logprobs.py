"""Chunked per-token log-probs: the same values and gradients as the plain log_softmax formula,
for any chunk size, and through a Hugging Face model's own forward (tied and untied heads), also
when the head sees only some positions, and with a timer around its forward and backward; no
[V, H] tensor is allocated per chunk, on the CPU path and on the CUDA path (bf16 GEMMs with fp32
outputs, run on the meta device); Liger gets an fp32 accumulator."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

import sys  # noqa: E402
import types  # noqa: E402
from typing import Any  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from staleflow.training import logprobs  # noqa: E402
from staleflow.training.logprobs import (  # noqa: E402
    chunk_tokens_for,
    chunked_token_logprobs,
    fp32_output_gemms,
    head_returns_logprobs,
    liger_token_logprobs,
)

pytestmark = pytest.mark.torch


def _plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 3), tokens=st.integers(1, 17), hidden_size=st.integers(1, 9), vocab=st.integers(2, 40),
       chunk=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_values_and_gradients_match_the_plain_formula(rows: int, tokens: int, hidden_size: int, vocab: int,
                                                       chunk: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, tokens, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (rows, tokens), generator=g)
    upstream = torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    results = []
    for fn in (_plain, lambda h, w, t: chunked_token_logprobs(h, w, t, chunk)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w, targets)
        (out.double() * upstream).sum().backward()
        results.append((out.double(), h.grad, w.grad))
    for plain, chunked in zip(*results, strict=True):
        assert torch.allclose(plain, chunked, rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 3), tokens=st.integers(1, 17), hidden_size=st.integers(1, 9), vocab=st.integers(2, 40),
       chunk=st.integers(1, 20), kept=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_the_head_at_some_positions_matches_the_plain_formula_there(rows: int, tokens: int, hidden_size: int,
                                                                     vocab: int, chunk: int, kept: float,
                                                                     seed: int) -> None:
    """The trainer's head: the hidden states at the response positions gathered first, then the
    chunked head over those alone; the same values there and the same gradients (zero elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, tokens, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (rows, tokens), generator=g)
    positions = torch.nonzero(torch.rand(rows * tokens, generator=g) < kept).flatten()
    upstream = torch.randn(len(positions), generator=g, dtype=torch.float64)
    results = []
    for gathered_first in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if gathered_first:
            out = chunked_token_logprobs(h.reshape(-1, hidden_size)[positions], w, targets.reshape(-1)[positions], chunk)
        else:
            out = _plain(h, w, targets).reshape(-1)[positions]
        (out.double() * upstream).sum().backward()
        results.append((out.double(), h.grad if h.grad is not None else torch.zeros_like(h),
                        w.grad if w.grad is not None else torch.zeros_like(w)))
    for plain, chunked in zip(*results, strict=True):
        assert torch.allclose(plain, chunked, rtol=1e-5, atol=1e-6)


def test_the_model_forward_returns_log_probs_without_logits() -> None:
    torch.manual_seed(0)
    for tied in (True, False):
        config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
        model = transformers.Qwen2ForCausalLM(config)
        ids = torch.randint(0, 97, (2, 11))
        targets = torch.roll(ids, -1, dims=1)
        plain = torch.log_softmax(model(input_ids=ids).logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        plain.sum().backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        with head_returns_logprobs(model, targets, chunk=5):
            chunked = model(input_ids=ids).logits
        chunked.sum().backward()
        assert chunked.shape == (2, 11) and torch.allclose(chunked, plain, atol=1e-5)
        for name, param in model.named_parameters():
            assert torch.allclose(param.grad, expected[name], atol=1e-5), name
        assert model(input_ids=ids).logits.shape == (2, 11, 97)  # the head is itself again


def test_auto_chunks_are_large_on_cuda_and_small_on_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert chunk_tokens_for(151_936, device=cpu) * 151_936 * 4 <= 1 << 25  # 32 MB of fp32 logits
    assert chunk_tokens_for(151_936) == chunk_tokens_for(151_936, device=cpu)
    big = chunk_tokens_for(151_936, device=cuda)
    assert big >= 1024 and (1 << 30) - 4 * 151_936 < big * 151_936 * 4 <= 1 << 30  # about 1 GB
    assert chunk_tokens_for(1_000_000, device=cuda) == 1024  # at least 1,024 tokens
    assert chunk_tokens_for(64) > 1000 and chunk_tokens_for(64, 7, cuda) == 7


def test_fp32_output_gemms_only_on_cuda_for_half_precision() -> None:
    assert not fp32_output_gemms(torch.device("cpu"), torch.bfloat16)  # CPU has no kernel for them
    assert not fp32_output_gemms(torch.device("cuda", 0), torch.float32)
    # torch.mm / addmm take out_dtype on the torch versions this trainer supports (2.11, 2.13)
    assert fp32_output_gemms(torch.device("cuda", 0), torch.bfloat16) == (
        hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out"))


def test_the_head_sees_only_the_given_positions_and_matches_the_full_head() -> None:
    torch.manual_seed(1)
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    ids = torch.randint(0, 97, (3, 9))
    targets = torch.roll(ids, -1, dims=1)
    positions = torch.tensor([2, 3, 4, 9 + 5, 9 + 6, 18 + 0, 18 + 7])
    with head_returns_logprobs(model, targets, chunk=4):
        full = model(input_ids=ids).logits.reshape(-1)[positions]
    full.sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    seen: list[tuple[int, ...]] = []
    original = logprobs.log_probs_of

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(tuple(hidden.shape))
        return original(hidden, *args, **kwargs)

    logprobs.log_probs_of = spy
    try:
        with head_returns_logprobs(model, targets.reshape(-1)[positions], chunk=4, positions=positions):
            picked = model(input_ids=ids).logits
    finally:
        logprobs.log_probs_of = original
    picked.sum().backward()
    assert seen == [(len(positions), 32)]  # the head saw the given positions and nothing else
    assert picked.shape == (len(positions),) and torch.allclose(picked, full, atol=1e-6)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6), name


class Allocations(TorchDispatchMode):
    """The shape of every tensor an op allocates (its results that alias no input: not views, not
    in-place or ``out=`` results), and the matrix multiplications run."""

    GEMMS = ("aten.mm.", "aten.addmm.", "aten.addmm_.", "aten.matmul.", "aten.bmm.")

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.gemms: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for declared, result in zip(func._schema.returns, results, strict=False):
            if isinstance(result, torch.Tensor) and declared.alias_info is None:
                self.shapes.append(tuple(result.shape))
        if str(func).startswith(self.GEMMS):
            self.gemms.append(str(func))
        return out


@pytest.mark.parametrize(("device", "dtype", "fp32_gemm"), [("cpu", torch.float32, False),
                                                           ("cpu", torch.bfloat16, False),
                                                           ("meta", torch.bfloat16, True)])
def test_no_vocab_by_hidden_tensor_per_chunk(device: str, dtype: torch.dtype, fp32_gemm: bool) -> None:
    """The weight's gradient accumulates in place (``addmm_``, or ``addmm(out_dtype=fp32, out=)``
    on CUDA, run here on the meta device): one [V, H] accumulator per backward, not one per chunk,
    and three GEMMs per chunk (the recomputed logits, the hidden's and the weight's gradients)."""
    vocab, hidden_size, tokens, chunk = 50, 12, 23, 5
    chunks = -(-tokens // chunk)
    hidden = torch.randn(tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=dtype, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    out = chunked_token_logprobs(hidden, weight, targets, chunk, fp32_gemm=fp32_gemm)
    upstream = torch.ones_like(out)
    with Allocations() as spy:
        out.backward(upstream)
    vocab_by_hidden = [s for s in spy.shapes if s == (vocab, hidden_size)]
    assert 1 <= len(vocab_by_hidden) <= 2, spy.shapes  # the accumulator (and its cast to the weight's dtype)
    assert len(spy.gemms) == 3 * chunks, spy.gemms
    if fp32_gemm:
        assert spy.gemms.count("aten.addmm.dtype_out") == chunks and "aten.mm.dtype" in spy.gemms


class FakeLiger:
    """A stand-in ``liger_kernel.transformers.functional`` (the real one needs CUDA and Triton):
    the per-token loss with no reduction is -logp; the keyword arguments are recorded."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def liger_fused_linear_cross_entropy(self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         bias: Any = None, ce_weight: Any = None, ignore_index: int = -100,
                                         lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                                         reduction: str = "mean", softcap: Any = None, return_z_loss: bool = False,
                                         accum_dtype: Any = None) -> torch.Tensor:
        self.calls.append({"reduction": reduction, "accum_dtype": accum_dtype})
        return -torch.log_softmax((input @ weight.t()).float(), -1).gather(-1, target[:, None]).squeeze(-1)


def test_liger_gets_no_reduction_and_an_fp32_accumulator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeLiger()
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fake.liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    hidden, weight = torch.randn(2, 3, 8), torch.randn(11, 8)
    targets = torch.randint(0, 11, (2, 3))
    got = liger_token_logprobs(hidden, weight, targets)
    assert fake.calls == [{"reduction": "none", "accum_dtype": torch.float32}]
    assert got.shape == (2, 3) and torch.allclose(got, chunked_token_logprobs(hidden, weight, targets, 2), atol=1e-5)


def test_the_head_timer_brackets_the_heads_forward_and_backward() -> None:
    """Begun and ended around the head's forward, then again around its backward: the backward's
    interval opens once the loss's gradient reaches the head and closes when the head is done."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=31, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.Qwen2ForCausalLM(config)
    events: list[str] = []
    original = logprobs.log_probs_of

    class Timer:
        def begin(self) -> None:
            events.append("begin")

        def end(self) -> None:
            events.append("end")

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        events.append("head forward")
        out = original(hidden, *args, **kwargs)
        out.register_hook(lambda grad: events.append("gradient into the head"))
        hidden.register_hook(lambda grad: events.append("gradient out of the head"))
        return out

    logprobs.log_probs_of = spy
    try:
        ids = torch.randint(0, 31, (1, 6))
        with head_returns_logprobs(model, torch.roll(ids, -1, 1), chunk=4, timer=Timer()):
            logp = model(input_ids=ids).logits
    finally:
        logprobs.log_probs_of = original
    assert events == ["begin", "head forward", "end"]
    logp.sum().backward()
    assert events[3:] == ["begin", "gradient into the head", "gradient out of the head", "end"], events
