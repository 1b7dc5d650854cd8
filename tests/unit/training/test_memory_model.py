"""The memory model behind ``max_tokens_per_micro_batch: auto``: the Qwen2.5-1.5B shape's budget
at 40 GiB per checkpointing policy, the per-layer bytes it rests on (the CPU measurements of one
such layer: 101 / 48 + 3 / 3 KiB per token), and how ``auto`` resolves on a CUDA device (its
memory passed in: no GPU needed) and on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from staleflow.config import TrainerConfig
from staleflow.training.memory_model import (
    MIN_AUTO_TOKENS,
    DecoderShape,
    auto_token_budget,
    fixed_bytes,
    policy_of,
    resolve_token_budget,
    saved_bytes_per_token_per_layer,
    token_budget,
)

GIB = 2**30
H200 = 141 * GIB
QWEN_1_5B = json.loads((Path(__file__).parents[3] / "deploy/models/qwen2.5-1.5b/config.json").read_text())
SHAPE = DecoderShape.of(SimpleNamespace(**QWEN_1_5B), parameters=1_543_714_304)
CUDA = SimpleNamespace(type="cuda", index=0)
CPU = SimpleNamespace(type="cpu", index=None)


def test_the_shape_is_read_off_the_config() -> None:
    assert (SHAPE.layers, SHAPE.hidden, SHAPE.intermediate, SHAPE.kv_width, SHAPE.vocab, SHAPE.tied) == \
        (28, 1536, 8960, 256, 151_936, True)


def test_per_layer_bytes_are_the_measured_ones_for_the_1_5b_layer() -> None:
    kib = {p: saved_bytes_per_token_per_layer(SHAPE, p) / 1024 for p in ("none", "selective", "full")}
    assert kib == {"none": pytest.approx(101, abs=1), "selective": pytest.approx(48 + 3, abs=1),
                   "full": pytest.approx(3, abs=0.1)}
    assert saved_bytes_per_token_per_layer(SHAPE, "selective", element_bytes=4) == 2 * 51 * 1024  # fp32: twice


def test_the_1_5b_budget_at_40_gib_per_policy() -> None:
    """About 9k tokens with selective checkpointing (the plan's 9-10k at 40 GiB), about half that
    with none, more than 60k with full checkpointing; the fixed part is the 23 GiB state plus the
    head's and the gathered layers' memory."""
    assert 23 * GIB < fixed_bytes(SHAPE, world=1, chunk_logit_bytes=GIB) < 28 * GIB
    budgets = {p: token_budget(SHAPE, p, 40 * GIB) for p in ("none", "selective", "full")}
    assert 8_500 <= budgets["selective"] <= 10_500, budgets
    assert 4_000 <= budgets["none"] <= 5_500, budgets
    assert budgets["full"] >= 60_000, budgets
    assert token_budget(SHAPE, "selective", 40 * GIB, world=2) > budgets["selective"]  # half the state per rank
    assert token_budget(SHAPE, "selective", 40 * GIB, offload=True) > budgets["selective"]
    assert token_budget(SHAPE, "selective", 40 * GIB, reference=True) < budgets["selective"]
    assert token_budget(SHAPE, "selective", 20 * GIB) == 0  # the state alone is 23 GiB


def test_a_plan_too_small_for_the_model_grows_to_the_device() -> None:
    assert auto_token_budget(SHAPE, "selective", H200, 40 * GIB, 1, GIB) == token_budget(SHAPE, "selective", 40 * GIB)
    on_the_device = token_budget(SHAPE, "selective", int(H200 * 0.95))
    assert auto_token_budget(SHAPE, "selective", H200, 24 * GIB, 1, GIB) == on_the_device > 40_000
    assert auto_token_budget(SHAPE, "selective", 24 * GIB, 40 * GIB, 1, GIB) == MIN_AUTO_TOKENS  # does not fit


def test_auto_resolves_to_a_budget_on_cuda_and_to_none_on_cpu() -> None:
    auto = TrainerConfig()
    assert auto.max_tokens_per_micro_batch == "auto"
    args = dict(shape=SHAPE, policy="selective", mixed_precision=True, chunk_tokens=1766, world=1)
    on_gpu = resolve_token_budget(auto, CUDA, device_memory=H200, **args)
    assert 8_500 <= on_gpu <= 10_500
    assert resolve_token_budget(auto, CPU, **args) is None
    assert resolve_token_budget(TrainerConfig(max_tokens_per_micro_batch=None), CUDA, device_memory=H200, **args) is None
    assert resolve_token_budget(TrainerConfig(max_tokens_per_micro_batch=4096), CUDA, device_memory=H200, **args) == 4096
    bigger = resolve_token_budget(TrainerConfig(token_budget_memory_gib=60), CUDA, device_memory=H200, **args)
    assert bigger > on_gpu
    full = resolve_token_budget(auto, CUDA, device_memory=H200, **{**args, "policy": "full"})
    assert full > on_gpu


def test_checkpointing_settings_as_policies() -> None:
    assert (policy_of(True), policy_of(False), policy_of("selective")) == ("full", "none", "selective")
    with pytest.raises(ValueError, match="unknown checkpointing policy"):
        policy_of("sometimes")
