"""Chunked per-token log-probs: the same values and gradients as the plain log_softmax formula,
for any chunk size, and through a Hugging Face model's own forward (tied and untied heads)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from staleflow.training.logprobs import chunk_tokens_for, chunked_token_logprobs, head_returns_logprobs  # noqa: E402

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


def test_auto_chunk_keeps_one_chunk_of_logits_small() -> None:
    assert chunk_tokens_for(151_936) * 151_936 <= 1 << 23
    assert chunk_tokens_for(64) > 1000 and chunk_tokens_for(64, 7) == 7
