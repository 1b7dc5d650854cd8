"""`staleflow up --engine vllm` end to end: vLLM (CPU build) rollouts, the FSDP2 trainer on two
gloo ranks, weights through the parameter server. The loop must close: versions advance, weights
reach the instances (with eta = 1, buffer 2 can only fill with trajectories generated at version
1 or later), every consumed trajectory is within the bound.

A randomly initialised tiny Qwen2 with the demo's tokenizer stands in for the warmed-up demo model
(its supervised warm-up is minutes of CPU); learning itself is the documented longer run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the real job needs vLLM (pip install 'staleflow[vllm,train]')")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from staleflow.training.demo import DemoSpec, train_tokenizer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.torch, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("random-demo")
    spec = DemoSpec()
    tokenizer = train_tokenizer(spec.task(), spec.vocab_size)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def test_real_job_closes_the_loop(model: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    command = [sys.executable, "-m", "staleflow.cli", "up", "--engine", "vllm", "--model", str(model),
               "--steps", "3", "--eta", "1", "--batch-size", "4", "--group-size", "4", "--instances", "1",
               "--trainer-ranks", "2", "--max-tokens", "8", "--state-dir", str(state), "--json-log"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, env=env)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((state / "logs").glob("*.log")))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs}"
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    end = events[-1]
    assert end["event"] == "end" and end["completed"] and end["staleness_violations"] == 0

    summary = json.loads((state / "report" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["trainer"].startswith("FSDP2")
    for step in summary["per_step"]:
        assert step["trajectories"] == 16 and step["response_tokens"] > 0
        assert all(0 <= int(k) <= 1 for k in step["staleness"])  # V_buf - V_traj within eta = 1
        metrics = step["metrics"]
        assert metrics["importance_weight_mean"] > 0 and metrics["grad_norm"] >= 0
    # buffer 2 holds only trajectories with V_traj >= 1: the instance ran pulled weights
    assert summary["per_step"][2]["staleness"].keys() <= {"0", "1"}
    assert (state / "trainer" / "checkpoints" / "latest.json").exists()
    seen = [i["version"] for e in events if e["event"] == "sample" for i in e["instances"].values()
            if i["version"] is not None]
    assert seen == sorted(seen) and max(seen) >= 1  # the instance's version only moves forward
