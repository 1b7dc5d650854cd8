"""Per-token log-probs of a causal LM without materialising its [tokens, vocab] logits.

``log_softmax(h @ W.T)[target]`` over a 152k vocabulary is the largest tensor of a train step
(4 x 2,304 tokens x 151,936 x 4 B = 5.6 GB in fp32, twice: logits and log-softmax). Here the
tokens go through the head in chunks: the forward keeps only each token's log-prob and its
log-sum-exp (fp32), and the backward recomputes one chunk's logits at a time, so the extra memory
is one chunk's logits whatever the sequence length. The gradient is exact:
d logp / d logits = onehot(target) - softmax.

The head sees only the positions whose log-probs are trained (the response tokens: the trainer
gathers their hidden states before the head, ``head_returns_logprobs(positions=...)``), not the
prompt or the padding.

On CUDA the chunks are large (about 1 GB of fp32 logits, at least ``MIN_CUDA_CHUNK_TOKENS``) and
the GEMMs run in bf16 on the tensor cores with fp32 outputs (``torch.mm`` / ``torch.addmm`` with
``out_dtype=torch.float32``, torch >= 2.8): the logits come out in fp32, and the weight's gradient
accumulates in place into one fp32 [V, H] buffer, with no [V, H] temporary per chunk. On CPU (or
without those overloads) the chunks stay small (32 MB of logits) and the GEMMs run in fp32.

On CUDA with ``liger_kernel`` importable (the ``liger`` extra), its fused linear cross-entropy
computes the same thing in Triton (``log_probs_of`` picks it, with an fp32 accumulator); the
chunked path is the fallback everywhere else and the reference the tests hold both to.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CUDA_CHUNK_LOGIT_BYTES = 1 << 30
"""On CUDA, one chunk's fp32 logits: about 1 GB (1,766 tokens at a 152k vocabulary). Large enough
that each chunk's GEMMs run near the tensor cores' peak and the weight is re-read rarely."""
MIN_CUDA_CHUNK_TOKENS = 1024
CPU_CHUNK_LOGIT_BYTES = 1 << 25
"""On CPU, one chunk's fp32 logits: 32 MB (with the softmax's gradient about 100 MB), 55 tokens at
a 152k vocabulary: the host's memory is what the CPU trainer runs short of, not FLOPs."""


def chunk_tokens_for(vocab: int, setting: int | str = "auto", device: torch.device | None = None) -> int:
    """Tokens per chunk: the setting, or (auto) as many as keep one chunk's fp32 logits near
    ``CUDA_CHUNK_LOGIT_BYTES`` on CUDA (at least ``MIN_CUDA_CHUNK_TOKENS``), near
    ``CPU_CHUNK_LOGIT_BYTES`` elsewhere."""
    if setting != "auto":
        return int(setting)
    if device is not None and device.type == "cuda":
        return max(MIN_CUDA_CHUNK_TOKENS, CUDA_CHUNK_LOGIT_BYTES // (4 * max(vocab, 1)))
    return max(16, CPU_CHUNK_LOGIT_BYTES // (4 * max(vocab, 1)))


def fp32_output_gemms(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether half-precision GEMMs can write fp32 here: ``torch.mm(..., out_dtype=torch.float32)``
    and ``torch.addmm(..., out_dtype=..., out=...)`` (the ``mm.dtype`` and ``addmm.dtype_out``
    overloads, torch >= 2.8, the same in 2.11 and 2.13), which have CUDA kernels only."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype_out"))


def _logits(h: torch.Tensor, weight: torch.Tensor, fp32_gemm: bool, dtype: torch.dtype) -> torch.Tensor:
    if fp32_gemm:
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return (h @ weight.t()).to(dtype)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                fp32_gemm: bool) -> torch.Tensor:
        acc = torch.promote_types(weight.dtype, torch.float32)  # fp32, or fp64 when the weights are
        hidden_shape = hidden.shape
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # not a view: FSDP hooks it
        hidden, flat_out, targets = hidden.reshape(-1, hidden.shape[-1]), out.view(-1), targets.reshape(-1)
        lse = torch.empty(targets.shape, dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[start:start + chunk], weight, fp32_gemm, acc)
            picked = logits.gather(-1, targets[start:start + chunk, None]).squeeze(-1)
            lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
            flat_out[start:start + chunk] = picked - lse[start:start + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.hidden_shape = hidden_shape
        ctx.chunk, ctx.fp32_gemm = chunk, fp32_gemm
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, fp32_gemm = ctx.chunk, ctx.fp32_gemm
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_out = grad_out.reshape(-1).to(lse.dtype)
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            h, g = hidden[start:end], grad_out[start:end, None]
            # d/dlogits of (logit[target] - logsumexp) times the incoming gradient, in place:
            # softmax = exp(logits - lse), with the forward's lse
            grad_logits = _logits(h, weight, fp32_gemm, lse.dtype).sub_(lse[start:end, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(-1, targets[start:end, None], g)
            if fp32_gemm:  # bf16 operands on the tensor cores; the weight's gradient accumulates in fp32
                grad_logits = grad_logits.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits @ weight
                if grad_weight is not None:
                    torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=torch.float32, out=grad_weight)
                continue
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.to(lse.dtype))
        return (grad_hidden.reshape(ctx.hidden_shape) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                           fp32_gemm: bool | None = None) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T).gather(targets)`` in fp32, for ``hidden`` [..., H] and
    ``targets`` [...], holding one chunk's logits at a time in forward and backward.
    ``fp32_gemm``: half-precision GEMMs with fp32 outputs (default: where the device has them)."""
    if fp32_gemm is None:
        fp32_gemm = fp32_output_gemms(hidden.device, weight.dtype) and hidden.dtype == weight.dtype
    return _ChunkedTokenLogProbs.apply(hidden, weight, targets, chunk, fp32_gemm)


def liger_available(device: torch.device, module: str = "liger_kernel.ops.fused_linear_cross_entropy") -> bool:
    """Whether Liger's ``module`` can run here: importable, and on CUDA (Triton has no CPU driver)."""
    if device.type != "cuda":
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def liger_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same per-token log-probs through Liger's fused linear cross-entropy (CUDA, Triton):
    its per-token loss with no reduction is -logp. The weight's gradient accumulates in fp32
    (``accum_dtype``, where the installed Liger has it)."""
    from liger_kernel.transformers.functional import (  # pyright: ignore[reportMissingImports]  (the liger extra)
        liger_fused_linear_cross_entropy,
    )

    options: dict[str, Any] = {"reduction": "none"}
    if "accum_dtype" in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        options["accum_dtype"] = torch.float32
    shape = targets.shape
    loss = liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            **options)
    if isinstance(loss, tuple):
        loss = loss[0]
    return (-loss.float()).reshape(shape).clone()  # not a view: FSDP hooks the forward's output


def log_probs_of(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                 use_liger: bool = False) -> torch.Tensor:
    if use_liger:
        return liger_token_logprobs(hidden, weight, targets)
    return chunked_token_logprobs(hidden, weight, targets, chunk)


class _BackwardMark(torch.autograd.Function):
    """The identity, whose backward calls ``mark`` as the gradient passes: placed before and after
    the head, it brackets the head's backward for a timer."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, mark: Callable[[], None]) -> torch.Tensor:
        ctx.mark = mark
        return tensor.clone()  # not a view: FSDP hooks the forward's output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.mark()
        return grad, None


class HeadTimer(Protocol):
    """What ``head_returns_logprobs`` needs of a timer (``staleflow.training.metering.SectionTimer``)."""

    def begin(self) -> None: ...

    def end(self) -> None: ...


@contextlib.contextmanager
def head_returns_logprobs(model: PreTrainedModel, targets: torch.Tensor, chunk: int, use_liger: bool = False,
                          positions: torch.Tensor | None = None, timer: HeadTimer | None = None) -> Iterator[None]:
    """While inside, the model's output head returns log-probs of ``targets`` instead of logits.

    Without ``positions``, every position's (``targets`` has the positions' shape):
    ``model(...).logits`` is then [B, T] fp32. With ``positions`` (indices into the flattened
    positions, B x T), only those: the head gathers their hidden states first and sees nothing
    else, and ``model(...).logits`` is [len(positions)] fp32, the log-prob of ``targets[i]`` at
    ``positions[i]``.

    The head runs inside the model's own forward, so an FSDP2 root has its parameters (the head,
    or the tied embedding) gathered there and reduce-scatters their gradient as usual. ``timer``,
    if given, is begun and ended around the head's forward and its backward."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no linear output head: cannot compute per-token log-probs")
    if getattr(head, "bias", None) is not None:
        raise ValueError("an output head with a bias is not supported by the chunked log-probs")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if positions is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1])[positions]
        if timer is not None:
            timer.begin()
            hidden = _BackwardMark.apply(hidden, timer.end)  # its backward runs once the head's is done
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"head input {tuple(hidden.shape)} does not match targets {tuple(targets.shape)}")
        logp = log_probs_of(hidden, head.weight, targets, chunk, use_liger)
        if timer is not None:
            logp = _BackwardMark.apply(logp, timer.begin)  # its backward runs before the head's
            timer.end()
        return logp

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward
