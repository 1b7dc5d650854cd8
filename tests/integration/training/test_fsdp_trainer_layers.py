"""The FSDP2 trainer's layer settings on one gloo rank: selective checkpointing trains what no
checkpointing trains, reruns no matmul in backward and keeps less than no checkpointing but more
than full; packed rows go through the registered varlen attention with no mask and no cache;
Liger's patch (a recording stand-in: Triton has no CPU) runs before the layers are sharded and
keeps the state-dict names; compiled layers train what eager ones train with one graph."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_fsdp_trainer_core import _backend, _batch

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from staleflow.training import fsdp  # noqa: E402
from staleflow.training.attention import PACKED_ATTENTION  # noqa: E402
from staleflow.training.fsdp import FsdpBackend  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]



MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


class KeptStorages(TorchDispatchMode):
    """The storages the ops inside produce; ``bytes_alive()``: those still held (by autograd,
    or by selective checkpointing's cache) once the forward is done, each once."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                self.made.setdefault(id(storage), weakref.ref(storage))
        return out

    def bytes_alive(self) -> int:
        gc.collect()
        return sum(storage.nbytes() for ref in self.made.values() if (storage := ref()) is not None)


@dataclass
class Backward:
    """One micro-batch of every row's response log-probs through the trainer's model."""

    logp: torch.Tensor  # [rows, width - 1], zero outside the responses
    grads: dict[str, torch.Tensor]
    matmuls: int  # aten mm / addmm / bmm run in backward, recomputation included
    kept_bytes: int  # what the forward left alive for backward


def _one_backward(backend: FsdpBackend) -> Backward:
    rows = _batch()["trajectories"]
    inputs, head, mask, _ = backend._tensors(rows, live=True)
    with KeptStorages() as forward:
        logp = backend._token_logp(backend.model, inputs, head) * mask
    kept = forward.bytes_alive()
    upstream = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)  # a different weight per token
    with MatmulCount() as matmuls:
        (logp * upstream).sum().backward()
    grads = {name: p.grad.full_tensor().clone() for name, p in backend.model.named_parameters()}
    return Backward(logp.detach(), grads, matmuls.count, kept)


def _assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_selective_checkpointing_recomputes_no_matmul_and_keeps_less(model_dir: Path, tmp_path: Path,
                                                                     one_rank: None) -> None:
    runs = {}
    for setting in (False, "selective", True):
        backend = _backend(model_dir, tmp_path / str(setting), activation_checkpointing=setting)
        runs[backend.settings.activation_checkpointing] = _one_backward(backend)
    none, selective, full = runs["none"], runs["selective"], runs["full"]
    _assert_same_gradients(selective.grads, none.grads)
    _assert_same_gradients(full.grads, none.grads)
    assert selective.matmuls == none.matmuls < full.matmuls, (none.matmuls, selective.matmuls, full.matmuls)
    assert none.kept_bytes > selective.kept_bytes > full.kept_bytes, (none.kept_bytes, selective.kept_bytes,
                                                                       full.kept_bytes)


def test_packed_rows_give_the_log_probs_and_gradients_of_padded_rows(model_dir: Path, tmp_path: Path,
                                                                      one_rank: None) -> None:
    packed = _backend(model_dir, tmp_path / "packed", packing=True)
    padded = _backend(model_dir, tmp_path / "padded", packing=False)
    assert packed.model.config._attn_implementation == PACKED_ATTENTION and not padded.packing
    got, expected = _one_backward(packed), _one_backward(padded)
    assert expected.logp.abs().sum() > 0
    torch.testing.assert_close(got.logp, expected.logp, rtol=1e-5, atol=1e-6)
    _assert_same_gradients(got.grads, expected.grads)


class AttentionSpy:
    """Wraps the registered packed attention and every mask builder of transformers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.calls: list[dict[str, Any]] = []
        self.masks_built: list[str] = []
        attend = ALL_ATTENTION_FUNCTIONS[PACKED_ATTENTION]

        def spy(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                **kwargs: Any) -> Any:
            self.calls.append({"mask": attention_mask, "shape": tuple(query.shape), **kwargs})
            return attend(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, PACKED_ATTENTION, spy)
        for name, build in dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping).items():
            monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, self._recording(name, build))
        self.caches: list[Any] = []
        init = transformers.DynamicCache.__init__
        monkeypatch.setattr(transformers.DynamicCache, "__init__",
                            lambda cache, *a, **k: (self.caches.append(cache), init(cache, *a, **k))[1])

    def _recording(self, name: str, build: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.masks_built.append(name)
            return build(*args, **kwargs)
        return call


def test_packed_rows_take_the_registered_attention_with_no_mask_and_no_cache(model_dir: Path, tmp_path: Path,
                                                                            one_rank: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache left on would hide the packed rows from transformers' own mask detection (sequences
    attending across their boundaries): the trainer turns it off, and builds no mask at all."""
    backend = _backend(model_dir, tmp_path, packing=True, max_tokens_per_micro_batch=30)
    assert backend.packing and backend.model.config._attn_implementation == PACKED_ATTENTION
    assert backend.model.config.use_cache is False
    spy = AttentionSpy(monkeypatch)
    metrics = backend.train(0, _batch())
    layers = backend.model.config.num_hidden_layers
    assert len(spy.calls) == layers * metrics["micro_batches"]
    assert spy.masks_built == [] and spy.caches == []
    for call in spy.calls:
        assert call["mask"] is None and call["shape"][0] == 1 and not call.get("use_cache")
        cu = call["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and int(cu[-1]) == call["shape"][2]
        assert call["max_length_q"] == int((cu[1:] - cu[:-1]).max())


@pytest.fixture
def recording_liger(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A ``liger_kernel.transformers`` whose Qwen2 patch records when it ran relative to
    ``fully_shard`` and binds a forward onto each RMSNorm instance (as Liger does: same
    parameters, another forward)."""
    from torch.distributed import fsdp as torch_fsdp

    events: list[str] = []

    def apply_liger_kernel_to_qwen2(rope: bool = True, cross_entropy: bool = False,
                                    fused_linear_cross_entropy: bool = True, rms_norm: bool = True,
                                    swiglu: bool = True, model: Any = None) -> None:
        events.append("liger")
        for module in model.modules():
            if type(module).__name__ == "Qwen2RMSNorm":
                module.forward = types.MethodType(type(module).forward, module)

    module = types.ModuleType("liger_kernel.transformers")
    module.apply_liger_kernel_to_qwen2 = apply_liger_kernel_to_qwen2  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    shard = torch_fsdp.fully_shard
    monkeypatch.setattr(torch_fsdp, "fully_shard", lambda *a, **k: (events.append("fully_shard"), shard(*a, **k))[1])
    monkeypatch.setattr(fsdp, "fused_kernels_for", lambda setting, *_: setting is True)  # as if on CUDA
    return events


def test_liger_patches_the_layers_before_they_are_sharded_and_keeps_their_names(
        model_dir: Path, tmp_path: Path, one_rank: None, recording_liger: list[str]) -> None:
    plain = _backend(model_dir, tmp_path / "plain", fused_kernels=False)
    assert "liger" not in recording_liger
    recording_liger.clear()
    patched = _backend(model_dir, tmp_path / "patched", fused_kernels=True)
    assert recording_liger[0] == "liger" and recording_liger.count("liger") == 1
    assert recording_liger[1:] == ["fully_shard"] * (plain.model.config.num_hidden_layers + 1)
    assert list(patched.model.state_dict()) == list(plain.model.state_dict())
    assert patched.train(0, _batch())["loss"] == pytest.approx(plain.train(0, _batch())["loss"])


def test_compile_is_refused_where_torch_compile_is_disabled(model_dir: Path, tmp_path: Path, one_rank: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    with pytest.raises(ValueError, match="compile: false"):
        _backend(model_dir, tmp_path, compile=True)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first compile takes minutes on two loaded cores
def test_compiled_layers_train_what_eager_layers_train_with_one_graph(model_dir: Path, tmp_path: Path, one_rank: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    # an in-process vLLM engine earlier in the session sets it (its enforce_eager instances)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)

    torch._dynamo.reset()
    counters.clear()
    backends = {compiled: _backend(model_dir, tmp_path / str(compiled), compile=compiled,
                                   activation_checkpointing="selective") for compiled in (False, True)}
    trajectories = _batch(n=6)["trajectories"]
    # three widths, each micro-batch two rows of unequal length: one row would specialise the batch
    # size, and rows of equal length (no padding) would pass no mask where the others pass one
    for pair in ((0, 2), (1, 4), (3, 5)):
        rows = [trajectories[i] for i in pair]
        grads = {}
        for compiled, backend in backends.items():
            inputs, head, mask, _ = backend._tensors(rows, live=True)
            (backend._token_logp(backend.model, inputs, head) * mask).sum().backward()
            grads[compiled] = {n: p.grad.full_tensor().clone() for n, p in backend.model.named_parameters()}
            backend.model.zero_grad(set_to_none=True)
        for name, grad in grads[False].items():
            torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
