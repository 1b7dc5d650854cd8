"""Per-token log-probs of a causal LM without materialising its [tokens, vocab] logits.

``log_softmax(h @ W.T)[target]`` over a 152k vocabulary is the largest tensor of a train step
(4 x 2,304 tokens x 151,936 x 4 B = 5.6 GB in fp32, twice: logits and log-softmax). Here the
tokens go through the head in chunks: the forward keeps only each token's log-prob (fp32), and
the backward recomputes one chunk's logits at a time, so the extra memory is one chunk's logits
whatever the sequence length. The gradient is exact: d logp / d logits = onehot(target) - softmax.

On CUDA with ``liger_kernel`` importable (the ``liger`` extra), its fused linear cross-entropy
computes the same thing in Triton (``log_probs_of`` picks it); the chunked path is the fallback
everywhere else and the reference the tests hold both to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

CHUNK_LOGIT_ELEMENTS = 1 << 23
"""Logits held at once by the chunked head in auto mode: 8M fp32 values (32 MB; with the
softmax and its gradient about 100 MB), i.e. 55 tokens at a 152k vocabulary."""


def chunk_tokens_for(vocab: int, setting: int | str = "auto") -> int:
    """Tokens per chunk: the setting, or (auto) as many as keep one chunk's logits near
    ``CHUNK_LOGIT_ELEMENTS``."""
    if setting != "auto":
        return int(setting)
    return max(16, CHUNK_LOGIT_ELEMENTS // max(vocab, 1))


class _ChunkedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        hidden_shape = hidden.shape
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # not a view: FSDP hooks it
        hidden, flat_out, targets = hidden.reshape(-1, hidden.shape[-1]), out.view(-1), targets.reshape(-1)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start:start + chunk] @ weight.t()).float()
            picked = logits.gather(-1, targets[start:start + chunk, None]).squeeze(-1)
            flat_out[start:start + chunk] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.hidden_shape = hidden_shape
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_out = grad_out.reshape(-1).float()
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            logits = (h @ weight.t()).float()
            # d/dlogits of (logit[target] - logsumexp) times the incoming gradient, in place
            grad_logits = torch.softmax(logits, dim=-1).mul_(-grad_out[start:start + chunk, None])
            del logits
            grad_logits.scatter_add_(-1, targets[start:start + chunk, None], grad_out[start:start + chunk, None])
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ h.float())
        return (grad_hidden.reshape(ctx.hidden_shape) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           chunk: int) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T).gather(targets)`` in fp32, for ``hidden`` [..., H] and
    ``targets`` [...], holding one chunk's logits at a time in forward and backward."""
    return _ChunkedTokenLogProbs.apply(hidden, weight, targets, chunk)


def liger_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def liger_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same per-token log-probs through Liger's fused linear cross-entropy (CUDA, Triton):
    its per-token loss with no reduction is -logp."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    shape = targets.shape
    loss = liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            reduction="none")
    if isinstance(loss, tuple):
        loss = loss[0]
    return (-loss.float()).reshape(shape).clone()  # not a view: FSDP hooks the forward's output


def log_probs_of(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                 use_liger: bool = False) -> torch.Tensor:
    if use_liger:
        return liger_token_logprobs(hidden, weight, targets)
    return chunked_token_logprobs(hidden, weight, targets, chunk)


@contextlib.contextmanager
def head_returns_logprobs(model: torch.nn.Module, targets: torch.Tensor, chunk: int,
                          use_liger: bool = False) -> Iterator[None]:
    """While inside, the model's output head returns each position's log-prob of ``targets``
    (same shape as the positions) instead of logits: ``model(...).logits`` is then [B, T] fp32.

    The head runs inside the model's own forward, so an FSDP2 root has its parameters (the head,
    or the tied embedding) gathered there and reduce-scatters their gradient as usual."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no linear output head: cannot compute per-token log-probs")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"head input {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}")
        if getattr(head, "bias", None) is not None:
            raise ValueError("an output head with a bias is not supported by the chunked log-probs")
        return log_probs_of(hidden, head.weight, targets, chunk, use_liger)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward
