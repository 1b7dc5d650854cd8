"""``staleflow bench trainer`` on CPU: a tiny Qwen2 config.json (random weights) trained by the real
FSDP2 backend on gloo; its JSON is complete and its numbers agree with each other and with the
model's parameter count; bad input gets a message with a fix, never a traceback; the trainer
role's steps carry the same numbers into the job's tracking."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

torch = pytest.importorskip("torch", reason="the trainer needs torch (pip install 'staleflow[train]')")
transformers = pytest.importorskip("transformers", reason="the trainer needs transformers")

from staleflow.cli.main import app  # noqa: E402
from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.tracking import step_metrics  # noqa: E402
from staleflow.training.bench import (  # noqa: E402
    HOST_BYTES_PER_PARAMETER,
    LONGTAIL_AT_MAX_EVERY,
    BenchInputError,
    check_host_memory,
    check_ranks_fit,
    response_lengths,
)
from staleflow.training.metering import MeteredBackend, StepMeter, trained_tokens  # noqa: E402
from staleflow.training.simulated import SimulatedBackend  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

TINY_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
              "max_position_embeddings": 256}


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    return path


def _bench(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, in its own process (ranks set the rendezvous environment)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "staleflow.cli", "bench", "trainer", *args], capture_output=True,
                          text=True, timeout=280, env=env)


def test_json_numbers_agree_with_the_model_and_each_other(tiny_config: Path) -> None:
    batch, prompt, response, steps = 6, 8, 24, 2
    result = _bench("--model", str(tiny_config), "--batch", str(batch), "--prompt-tokens", str(prompt),
                    "--response-tokens", str(response), "--steps", str(steps), "--group-size", "3", "--json",
                    "--set", "algorithm.micro_batch=2")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    expected_params = sum(p.numel() for p in transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2))
                          .parameters())  # tied: the embedding counts once
    assert out["params"] == expected_params and out["random_init"] is True
    assert out["architecture"] == "Qwen2ForCausalLM"
    assert (out["device"], out["peak_tflops"], out["mfu"]) == ("cpu", None, None)
    assert out["trainer"]["algorithm"]["micro_batch"] == 2 and out["world_size"] == 1
    # fp32 parameters, one fp32 gradient each, AdamW's two moments plus a step counter per tensor
    state = out["state"]
    assert state["parameters"] == state["gradients"] == 4 * expected_params
    tensors = len(list(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2)).parameters()))
    assert 8 * expected_params + 4 * tensors <= state["optimizer"] <= 8 * expected_params + 8 * tensors
    assert out["state_bytes"] == state["parameters"] + state["gradients"] + state["optimizer"]
    assert out["tokens_per_step"] == batch * (prompt + response)
    assert len(out["steps"]) == steps and all(s > 0 for s in out["steps"])
    assert out["warmup_steps_excluded"] == 1
    assert out["tokens_per_s"] == pytest.approx(out["tokens_per_step"] / out["steps"][1])
    assert out["memory_kind"] == "process RSS"
    assert 0 <= out["activation_peak_bytes"] < out["peak_memory_bytes"]
    # the head's timer: inside every step, forward and backward, and a part of it
    assert len(out["head_seconds"]) == steps and all(0 < h < s for h, s in zip(out["head_seconds"], out["steps"], strict=True))
    assert out["head_share"] == pytest.approx(out["head_seconds"][1] / out["steps"][1])
    assert out["token_budget"] is None and out["trainer"]["max_tokens_per_micro_batch"] == "auto"  # auto: none on CPU
    assert out["per_rank"][0]["state_bytes"] == out["state_bytes"]
    assert math.isfinite(out["last_metrics"]["loss"])


@pytest.mark.slow
def test_two_ranks_share_the_state(tiny_config: Path) -> None:
    result = _bench("--model", str(tiny_config), "--steps", "1", "--batch", "4", "--world-size", "2", "--json",
                    "--response-dist", "longtail")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["world_size"] == 2 and [r["rank"] for r in out["per_rank"]] == [0, 1]
    # each rank holds its shard (tensors with fewer rows than ranks sit on one rank): together the
    # whole state, 16 bytes per parameter plus AdamW's step counters, no rank all of it
    assert 16 * out["params"] <= out["state_bytes"] <= 16 * out["params"] + 2 * 8 * 64
    assert all(0 < r["state_bytes"] < 0.75 * out["state_bytes"] for r in out["per_rank"])
    assert len(out["steps"]) == 1 and out["warmup_steps_excluded"] == 0
    assert out["tokens_per_s"] == pytest.approx(out["tokens_per_step"] / out["steps"][0])


@pytest.mark.parametrize(("config", "message"), [
    (None, "does not exist"),
    ({"model_type": "no-such-architecture", "vocab_size": 8}, "not an architecture transformers"),
    ({"model_type": "vit"}, "not a causal LM"),
    ({"vocab_size": 8}, "names no model_type"),
])
def test_bad_models_get_a_message_and_a_fix(tmp_path: Path, config: dict | None, message: str) -> None:
    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["bench", "trainer", "--model", str(path), "--json"])
    assert result.exit_code == 2, result.output
    assert message in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


def test_bad_trainer_settings_name_the_setting(tiny_config: Path) -> None:
    runner = CliRunner()
    unknown = runner.invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--set", "algorithm.micro_bach=4"])
    assert unknown.exit_code == 2 and "micro_bach" in unknown.output and "micro_batch" in unknown.output
    wrong = runner.invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--set", "algorithm.micro_batch=0"])
    assert wrong.exit_code == 2 and "--set algorithm.micro_batch" in wrong.output
    shape = runner.invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--set", "nonsense"])
    assert shape.exit_code == 2 and "key=value" in shape.output
    dist = runner.invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--response-dist", "zipf"])
    assert dist.exit_code == 2 and "uniform, longtail" in dist.output
    for result in (unknown, wrong, shape, dist):
        assert "Traceback" not in result.output


def test_settings_this_machine_cannot_honour_are_refused_before_anything_starts(tiny_config: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("Liger's kernels may run here: the refusal is for a machine without CUDA")
    result = CliRunner().invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--set", "fused_kernels=true"])
    assert result.exit_code == 2 and "fused_kernels: true needs CUDA and liger_kernel" in result.output
    assert "fix:" in result.output and "Traceback" not in result.output


def test_packing_on_attention_that_cannot_take_packed_rows_is_refused_before_anything_starts(
        tiny_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transformers.Qwen2ForCausalLM, "_supports_attention_backend", False)
    result = CliRunner().invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--set", "packing=true"])
    assert result.exit_code == 2 and "cannot take packed rows" in result.output
    assert "fix:" in result.output and "Traceback" not in result.output


def test_a_token_budget_below_the_prompt_is_refused(tiny_config: Path) -> None:
    if "max_tokens_per_micro_batch" not in TrainerConfig.model_fields:
        pytest.skip("this trainer has no token budget per micro-batch")
    result = CliRunner().invoke(app, ["bench", "trainer", "--model", str(tiny_config), "--prompt-tokens", "32",
                                      "--set", "max_tokens_per_micro_batch=16"])
    assert result.exit_code == 2 and "smaller than the prompt" in result.output and "fix:" in result.output


def test_a_state_larger_than_host_memory_is_refused_before_it_is_built() -> None:
    cfg = TrainerConfig()
    check_host_memory(10**6, cfg, on_cuda=False, available=HOST_BYTES_PER_PARAMETER * 10**6)
    with pytest.raises(BenchInputError) as refused:
        check_host_memory(10**6 + 1, cfg, on_cuda=False, available=HOST_BYTES_PER_PARAMETER * 10**6)
    assert "on CPU" in refused.value.message and "1,000,001 parameters" in refused.value.message
    check_host_memory(10**9, cfg, on_cuda=True, available=0)  # on the GPU: the host holds none of it
    if "optimizer_offload" in TrainerConfig.model_fields:
        with pytest.raises(BenchInputError, match="with optimizer offload"):
            check_host_memory(10**9, TrainerConfig(optimizer_offload=True), on_cuda=True, available=10**9)


def test_more_ranks_than_gpus_names_both_numbers() -> None:
    check_ranks_fit(2, 2)
    with pytest.raises(BenchInputError) as refused:
        check_ranks_fit(3, 2)
    assert "3 ranks" in refused.value.message and "2 GPUs" in refused.value.message
    assert "--world-size 2" in refused.value.fix


@given(batch=st.integers(1, 300), longest=st.integers(1, 20_000), seed=st.integers(0, 2**16))
def test_longtail_is_mostly_short_with_a_few_at_the_maximum(batch: int, longest: int, seed: int) -> None:
    lengths = response_lengths(batch, longest, "longtail", seed)
    assert len(lengths) == batch and all(1 <= n <= longest for n in lengths)
    assert lengths.count(longest) >= max(1, math.ceil(batch / LONGTAIL_AT_MAX_EVERY))
    short = [n for n in lengths if n != longest]
    assert all(n <= max(1, round(longest / 8)) for n in short)
    assert lengths == response_lengths(batch, longest, "longtail", seed)  # seeded
    assert response_lengths(batch, longest, "uniform", seed) == [longest] * batch


def test_the_trainer_roles_steps_carry_the_bench_numbers_into_tracking() -> None:
    batch = {"version": 0, "trajectories": [{"group_id": "g0", "prompt_ids": [1, 2, 3], "tokens": [4, 5],
                                             "logprobs": [-1.0, -1.0], "reward": 1.0, "v_traj": 0}] * 4}
    simulated = SimulatedBackend(seconds_per_step=0.01, seconds_per_token=0.0, push_bytes=8, speed=1.0,
                                 stop=threading.Event())
    backend = MeteredBackend(simulated, StepMeter(torch.device("cpu"), parameters=1000, world_size=1))
    metrics = backend.train(0, batch)
    assert trained_tokens(batch) == 20
    assert metrics["tokens_per_second"] == pytest.approx(20 / metrics["step_seconds"])
    assert metrics["peak_memory_bytes"] > 0 and "mfu" not in metrics  # no MFU without a GPU's peak
    record = {"mean_reward": 1.0, "mean_length": 2.0, "max_length": 2, "response_tokens": 8, "trajectories": 4,
              "staleness": {"0": 4}, "finished_at": 1.0, "train_seconds": metrics["train_seconds"], "metrics": metrics}
    scalars, _ = step_metrics(record, None)
    assert scalars["train/tokens_per_second"] == pytest.approx(metrics["tokens_per_second"])
    assert scalars["train/peak_memory_bytes"] == metrics["peak_memory_bytes"]


ROLE_STEP = """
import json, sys
from pathlib import Path
import torch, transformers
from staleflow.config import TrainerConfig
from staleflow.ports import free_port
from staleflow.training.bench import synthetic_batch, BenchSpec
from staleflow.training.metering import MeteredBackend, trained_tokens
from staleflow.training.fsdp import FsdpBackend, RankDriver, init_process_group
model_dir, checkpoints = Path(sys.argv[1]), Path(sys.argv[2])
transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**json.loads(sys.argv[3]))).save_pretrained(model_dir)
init_process_group(0, 1, free_port())
driver = RankDriver(FsdpBackend(TrainerConfig(world_size=1), model_dir, checkpoints, 0, 1, 1))
batch = synthetic_batch(BenchSpec(model=model_dir, batch=4, prompt_tokens=4, response_tokens=8), 96)
metrics = MeteredBackend.around(driver).train(0, batch)
print(json.dumps({"metrics": metrics, "tokens": trained_tokens(batch),
                  "params": sum(p.numel() for p in driver.local.model.parameters())}))
"""


@pytest.mark.slow
def test_the_fsdp_trainer_roles_backend_is_metered(tmp_path: Path) -> None:
    """The trainer role's own wrapping (``MeteredBackend.around`` a ``RankDriver``) on the real backend."""
    result = subprocess.run([sys.executable, "-c", ROLE_STEP, str(tmp_path / "model"), str(tmp_path / "checkpoints"),
                             json.dumps({k: v for k, v in TINY_QWEN2.items() if k not in ("model_type", "architectures")})],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    metrics = out["metrics"]
    assert out["tokens"] == 4 * (4 + 8)
    assert metrics["tokens_per_second"] == pytest.approx(out["tokens"] / metrics["step_seconds"])
    assert metrics["step_seconds"] >= metrics["train_seconds"] > 0
    assert metrics["peak_memory_bytes"] > 0 and "mfu" not in metrics and math.isfinite(metrics["loss"])
