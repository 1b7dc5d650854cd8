"""`staleflow calibrate --engine vllm --model <the demo model>` with no other flag, as a new user runs
it: max_model_len and the CPU KV cache are derived from the model and the machine, the engine starts,
and the command ends with a fit it accepts (exit 0, the entry written with ok = true and a
cross-validated error within the 15 % limit) or with a refusal that says why (exit 3, no
traceback), never with a traceback.

The model has the demo model's architecture and tokenizer with random weights: what a decode step
costs depends on the architecture, not on the weights (the generation ignores EOS), and building
it takes seconds instead of the warm-up's minutes.

It profiles the default grid, minutes of CPU, so it is in the `smoke` tier:
`.venv/bin/pytest -q -m smoke tests/e2e/test_vllm_calibration_defaults.py`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [  # smoke: the default grid profiles for minutes; tests/e2e/test_vllm_calibration.py runs a small one
    pytest.mark.smoke, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install 'staleflow[vllm]'; see docs/calibrate.md)"),
]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from staleflow.calibration import load_entry  # noqa: E402
from staleflow.training.demo import DemoSpec, demo_config, train_tokenizer  # noqa: E402


def demo_architecture(directory: Path) -> Path:
    spec = DemoSpec()
    tokenizer = train_tokenizer(spec.task(), spec.vocab_size)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(demo_config(spec, tokenizer)).save_pretrained(directory)
    return directory


def test_calibrate_the_demo_model_with_defaults(tmp_path: Path) -> None:
    model = demo_architecture(tmp_path / "demo")
    out = tmp_path / "calibration.json"
    done = subprocess.run([sys.executable, "-m", "staleflow.cli", "calibrate", "--engine", "vllm", "--model", str(model),
                           "--out", str(out), "--json"], capture_output=True, text=True, timeout=2300)
    (tmp_path / "stdout.json").write_text(done.stdout)  # kept for a look afterwards, whatever the outcome
    (tmp_path / "stderr.txt").write_text(done.stderr)
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert done.returncode in (0, 3), done.stderr[-4000:]
    doc = json.loads(done.stdout)
    entry = doc["calibration"]
    quality = entry["quality"]
    print(f"exit {done.returncode}: r2 {quality['r2']:.3f}, cross-validated error {quality['holdout_mape']:.2%}, "
          f"in sample {quality['mape']:.2%}; {quality['samples']} samples at {quality['grid_points']} points in "
          f"{entry['wall_seconds']:.0f} s; problems {entry['problems']}; warnings {entry['warnings']}")
    print("\n".join(line for line in done.stderr.splitlines() if not line.startswith(("(", "INFO", "WARNING", "W1"))
                     and "Warning" not in line)[-3000:])
    assert "derived max_model_len 512 (the model has 512 positions)" in done.stderr, "the model's positions, not 4096"
    assert "KV cache 1 GiB" in done.stderr, "sized for the grid, not 0.92 of the machine"
    if done.returncode == 0:
        assert entry["ok"] and quality["holdout_mape"] <= entry["thresholds"]["max_mape"]
        assert quality["r2"] >= entry["thresholds"]["min_r2"]
        written = load_entry(out, "demo", "tp1")
        assert written.cost.k3 > 0 and written.cost.kv_budget > 0
    else:  # refused: it says why and writes nothing
        assert not entry["ok"] and entry["problems"] and not out.exists()
        assert "POOR FIT, REFUSED" in done.stderr and "fix:" in done.stderr
