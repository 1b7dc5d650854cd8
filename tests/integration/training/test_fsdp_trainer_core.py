"""The FSDP2 trainer's core on one gloo rank: collectives see tensors on the backend's device and
no host transfer happens per micro-batch; packed micro-batches train what padded ones train;
padded rows need no attention mask, and the log-prob head sees the response tokens only;
micro-batches by token budget (auto: none on CPU); optimizer offload trains the same step; the meta-device sharded
load reproduces the saved weights; bad
input (too many ranks for the GPUs, a budget below a prompt, an unknown architecture) is refused
with a message that says what to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

import torch.distributed as dist  # noqa: E402

from staleflow.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from staleflow.training import fsdp, logprobs  # noqa: E402
from staleflow.training.fsdp import (  # noqa: E402
    FsdpBackend,
    check_gpus_for_ranks,
    row_count_batches,
    token_budget_batches,
)
from staleflow.training.loading import ModelLoadError, empty_causal_lm  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

STAFLEFLOW_CODE = str(Path(fsdp.__file__).parents[1])


def _batch(n: int = 6, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        length = 2 + (i * 5) % 9
        trajs.append({"group_id": f"g{i % 2}", "prompt_ids": torch.randint(3, 60, (3 + i % 3,), generator=g).tolist(),
                      "tokens": torch.randint(3, 60, (length,), generator=g).tolist(),
                      "logprobs": (-torch.rand(length, generator=g) * 3).tolist(), "reward": float(i % 3 == 0),
                      "v_traj": 0})
    return {"version": 0, "trajectories": trajs}


def _backend(model_dir: Path, tmp_path: Path, **settings: Any) -> FsdpBackend:
    algorithm = settings.pop("algorithm", {"lr": 1e-2, "micro_batch": 2})
    cfg = TrainerConfig(world_size=1, algorithm=AlgorithmConfig(**algorithm), **settings)
    return FsdpBackend(cfg, model_dir, tmp_path / "checkpoints", 0, 1, final_version=5)


class HostTransfers:
    """Counts, per call site in staleflow's own code, the calls that copy a tensor to the host or
    read its value there (a host sync on a GPU)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(STAFLEFLOW_CODE):
                self.calls.append(f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)
        return call


class CollectiveDevices:
    """Records the device of every tensor handed to a collective."""

    NAMES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "reduce",
             "all_to_all_single")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.seen: list[tuple[str, torch.device]] = []
        for name in self.NAMES:
            monkeypatch.setattr(dist, name, self._recording(name, getattr(dist, name)))

    def _recording(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, list) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        self.seen.append((name, tensor.device))
            return original(*args, **kwargs)
        return call


def test_collectives_on_the_device_and_no_host_transfer_per_micro_batch(model_dir: Path, tmp_path: Path, one_rank: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The class of bug that broke the first GPU run: statistics copied to the host (``.cpu()``)
    in every micro-batch and all-reduced there, which NCCL refuses."""
    transfers_per_run = []
    for micro_batch in (6, 1):  # one micro-batch, then six
        backend = _backend(model_dir, tmp_path / str(micro_batch), algorithm={"lr": 1e-2, "micro_batch": micro_batch})
        with monkeypatch.context() as patch:
            transfers, collectives = HostTransfers(patch), CollectiveDevices(patch)
            metrics = backend.train(0, _batch())
        assert metrics["micro_batches"] == 6 / micro_batch
        assert collectives.seen and {d for _, d in collectives.seen} == {backend.device}, collectives.seen
        transfers_per_run.append(transfers.calls)
    one, six = transfers_per_run
    assert len(one) == len(six), f"host transfers grow with the micro-batches: {six}"
    assert len(six) <= 3, six  # the micro-batch count, and the step's statistics once


def test_packed_micro_batches_train_what_padded_ones_train(model_dir: Path, tmp_path: Path, one_rank: None) -> None:
    runs = {}
    for packing in (True, False):
        backend = _backend(model_dir, tmp_path / str(packing), packing=packing, max_tokens_per_micro_batch=30)
        assert backend.packing is packing
        runs[packing] = (backend.train(0, _batch()), dict(backend.model.state_dict()))
    (packed, packed_state), (padded, padded_state) = runs[True], runs[False]
    assert packed["micro_batches"] < padded["micro_batches"]  # padding wastes the budget
    for key in ("loss", "negative_logp", "importance_weight_mean", "grad_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    for name, value in packed_state.items():
        assert torch.allclose(value.full_tensor(), padded_state[name].full_tensor(), atol=1e-5), name


def test_optimizer_offload_trains_the_same_step(model_dir: Path, tmp_path: Path, one_rank: None) -> None:
    runs = {}
    for offload in (False, True):
        backend = _backend(model_dir, tmp_path / str(offload), optimizer_offload=offload)
        metrics = backend.train(0, _batch())
        runs[offload] = metrics, {k: v.full_tensor() for k, v in backend.model.state_dict().items()}
        assert all(p.to_local().device.type == "cpu" for p in backend.model.parameters()) or not offload
    (plain, plain_state), (offloaded, offloaded_state) = runs[False], runs[True]
    assert offloaded["loss"] == pytest.approx(plain["loss"]) and offloaded["grad_norm"] == pytest.approx(plain["grad_norm"])
    for name, value in plain_state.items():
        assert torch.allclose(offloaded_state[name], value, atol=1e-6), name


def test_the_sharded_load_reproduces_the_saved_weights(model_dir: Path, tmp_path: Path, one_rank: None) -> None:
    backend = _backend(model_dir, tmp_path)
    saved = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    loaded = {k: v.full_tensor() for k, v in backend.model.state_dict().items()}
    assert set(loaded) == set(saved)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    rotary = [b for n, b in backend.model.named_buffers() if n.endswith("inv_freq")]
    assert rotary and all(torch.isfinite(b).all() and b.device == backend.device for b in rotary)


def test_a_budget_below_a_prompt_is_refused_with_the_fix(model_dir: Path, tmp_path: Path, one_rank: None) -> None:
    backend = _backend(model_dir, tmp_path, max_tokens_per_micro_batch=4)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch is 4 tokens but a prompt has 5.*at least 6"):
        backend.train(0, _batch())
    auto = _backend(model_dir, tmp_path / "auto")
    assert auto.cfg.max_tokens_per_micro_batch == "auto" and auto.token_budget is None  # auto on CPU: none
    auto.token_budget = 4  # as the memory model could resolve it on a small GPU
    with pytest.raises(ValueError, match=r"is 4 tokens \(auto, from the memory model\) but a prompt has 5.*at least 6"):
        auto.train(0, _batch())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_right_padded_rows_need_no_attention_mask(attention: str) -> None:
    """Causal attention never lets a real token see the pads after it: with and without the mask,
    the same log-probs at the real positions and the same gradients."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=attention)
    model = transformers.Qwen2ForCausalLM(config)
    lengths = [12, 7, 4]
    ids = torch.zeros((3, 12), dtype=torch.long)
    mask = torch.zeros((3, 12), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, 64, (n,))
        mask[i, :n] = 1
    real = mask[:, 1:].bool()
    weights = torch.randn(3, 11)
    runs = []
    for inputs in ({"input_ids": ids, "attention_mask": mask}, {"input_ids": ids}):
        model.zero_grad()
        logp = torch.log_softmax(model(**inputs).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (logp * weights)[real].sum().backward()
        runs.append((logp[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (with_mask, masked_grads), (without, grads) = runs
    assert torch.allclose(with_mask, without, atol=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grad, masked_grads[name], atol=1e-6), name


def test_padded_inputs_carry_no_mask_and_the_head_sees_the_response_tokens_only(
        model_dir: Path, tmp_path: Path, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend(model_dir, tmp_path)
    batch = _batch()
    inputs, head, mask, _ = backend._tensors(batch["trajectories"], live=True)
    assert set(inputs) == {"input_ids"} and not backend.packing
    responses = [len(t["tokens"]) for t in batch["trajectories"]]
    assert head.positions.numel() == head.targets.numel() == int(mask.sum()) == sum(responses)
    seen: list[int] = []
    original = logprobs.log_probs_of

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(logprobs, "log_probs_of", spy)
    metrics = backend.train(0, batch)
    assert len(seen) == metrics["micro_batches"] == 3  # micro-batches of 2 rows
    assert sum(seen) == sum(responses)  # no prompt position, no pad


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=0, max_size=30), budget=st.integers(1, 80), packed=st.booleans())
def test_token_budget_batches_cover_every_row_once_within_the_budget(lengths: list[int], budget: int,
                                                                     packed: bool) -> None:
    rows = dict(enumerate(lengths))
    batches = token_budget_batches(rows, budget, packed)
    assert sorted(r for b in batches for r in b) == sorted(rows)
    for batch in batches:
        cost = sum(rows[r] for r in batch) if packed else len(batch) * max(rows[r] for r in batch)
        assert cost <= budget or len(batch) == 1  # a row longer than the budget trains alone


def _padded_cost(batches: list[list[int]], rows: dict[int, int]) -> int:
    return sum(len(b) * max(rows[r] for r in b) for b in batches)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=0, max_size=30), size=st.integers(1, 8))
def test_row_count_batches_pad_no_more_than_arrival_order(lengths: list[int], size: int) -> None:
    rows = dict(enumerate(lengths))
    batches = row_count_batches(rows, size)
    assert sorted(r for b in batches for r in b) == sorted(rows)
    assert all(0 < len(b) <= size for b in batches)
    assert len(batches) == -(-len(rows) // size)  # no more forward passes than arrival order makes
    in_order = [list(rows)[i:i + size] for i in range(0, len(rows), size)]
    assert _padded_cost(batches, rows) <= _padded_cost(in_order, rows)


def test_a_long_tail_batch_pads_to_its_long_rows_once() -> None:
    rows = {i: 8192 if i % 16 == 0 else 300 for i in range(64)}  # four long responses among short ones
    batches = row_count_batches(rows, 32)
    assert _padded_cost(batches, rows) == 32 * 8192 + 32 * 300  # arrival order: 2 x 32 x 8192


def test_more_ranks_than_gpus_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_gpus_for_ranks(2)
    with pytest.raises(ValueError, match=r"3 trainer ranks on this node but only 2 GPUs.*at most 2"):
        check_gpus_for_ranks(3)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert fsdp.local_gpu(1) == 1  # the trainer's own spawn: rank i takes GPU i
    with pytest.raises(ValueError, match="only 2 GPUs"):
        fsdp.local_gpu(2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="only 2 GPUs"):
        fsdp.local_gpu(5)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert fsdp.local_gpu(3) == 0  # a launcher gave this rank its own GPU (Ray: CUDA_VISIBLE_DEVICES)


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "no-such-architecture"}, "no Hugging Face config.json"),
    ({"model_type": "vit", "architectures": ["ViTModel"]}, "'vit'.*is not a causal LM"),
])
def test_an_unsupported_architecture_is_refused(tmp_path: Path, config: dict, message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        empty_causal_lm(tmp_path)
