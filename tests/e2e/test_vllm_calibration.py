"""`staleflow calibrate --engine vllm` end to end on a tiny local Qwen2."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
from support import calibrate_cli as cli
from typer.testing import CliRunner

from staleflow.calibration import load_entry

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (pip install 'staleflow[vllm]'; see docs/calibrate.md)")
@pytest.mark.timeout(300)
def test_vllm_calibration_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small grid on a tiny local Qwen2: the pipeline works end to end (most of the time is the
    engine's start; no interval gating, so a busy machine adds no retries). It asserts nothing a
    loaded 2-core machine can flake: the accuracy is measured and reported in docs/calibrate.md."""
    from test_vllm_engine import (
        build_tiny_qwen2,  # sets the offline environment for vLLM too
    )

    for name, value in (("OMP_NUM_THREADS", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
        monkeypatch.setenv(name, value)  # what --cpu-threads 1 sets; restored after the test
    build_tiny_qwen2(tmp_path / "tiny", seed=0)
    out = tmp_path / "calibration.json"
    result = runner.invoke(cli(), [
        "calibrate", "--engine", "vllm", "--model", str(tmp_path / "tiny"), "--dtype", "float32",
        "--max-model-len", "1024", "--cpu-threads", "1", "--n-values", "1,8,32", "--contexts", "64,256",
        "--samples-per-point", "3", "--passes", "1", "--max-foreign-load", "64", "--prefill-contexts", "64,256",
        "--weight-loads", "1", "--bootstrap", "0", "--on-poor-fit", "warn", "--json",
        "--out", str(out), "--plot", str(tmp_path / "fig.png"),
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    entry = doc["calibration"]
    assert entry["model"] == "tiny" and entry["engine"] == "vllm" and entry["kv_unit"] == "token"
    assert all(entry["cost"][k] >= 0 for k in ("k1", "k2", "k3", "k4")) and entry["cost"]["k4"] + entry["cost"]["k2"] > 0
    assert 0.9 <= entry["cost"]["k5"] <= 2.0  # tokens per token, up to the block rounding of vLLM's KV usage
    assert entry["cost"]["kv_budget"] > 0 and entry["weight_load_seconds"] > 0
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "1":  # M is the whole 1 GiB KV cache
        assert entry["cost"]["kv_budget"] * entry["kv_bytes_per_token"] == pytest.approx(2**30, rel=0.01)
    quality = entry["quality"]
    assert quality["samples"] >= 4 and math.isfinite(quality["mape"]) and math.isfinite(quality["r2"])
    assert quality["holdout_mape"] is not None and entry["ok"] == (not entry["problems"])  # the fit reports itself
    assert all(s["latency"] > 0 and s["predicted"] > 0 for s in doc["samples"])
    assert (tmp_path / "fig.png").stat().st_size > 0
    assert load_entry(out, "tiny", "tp1", allow_poor=True).engine == "vllm"
