"""``staleflow bench params`` end to end on a tiny state dict: every cell measured, ratios present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.transports.nixl import nixl_available


def test_bench_params_reports_push_pull_and_end_to_end_per_cell(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sizes", "8MB", "--ranks", "1,2", "--instances", "1,2",
                                      "--repeats", "1", "--chunk-mb", "1", "--output", str(output)])
    assert result.exit_code == 0, result.output
    size = json.loads(output.read_text())["sizes"][0]
    assert size["memcpy"]["median_s"] > 0 and not size["skipped"]
    cells = {(c["transport"], c["ranks"], c["instances"]): c for c in size["cells"]}
    assert set(cells) == {(t, n, k) for t in ("shm", "http") for n in (1, 2) for k in (1, 2)}
    for cell in cells.values():
        assert 0 < cell["push_s"] <= cell["visible_s"] <= cell["end_to_end_s"]
        assert cell["pull_s"] > 0 and cell["persist_s"] >= 0 and cell["lease_after_visible_s"] >= 0
        for ratio in ("visible_vs_memcpy", "pull_vs_memcpy", "end_to_end_vs_copy_plus_pull"):
            assert cell[ratio] > 0, ratio
    assert size["shard_bytes"]["2"] < size["shard_bytes"]["1"]  # each of two ranks holds half


@pytest.mark.skipif(not nixl_available()[0], reason=nixl_available()[1])
def test_bench_params_pushes_and_pulls_over_nixl(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sizes", "4MB", "--ranks", "1", "--instances", "1", "--repeats", "1",
                                      "--chunk-mb", "1", "--transports", "nixl", "--output", str(output)])
    assert result.exit_code == 0, result.output
    (cell,) = json.loads(output.read_text())["sizes"][0]["cells"]
    assert cell["transport"] == "nixl" and 0 < cell["push_s"] <= cell["visible_s"] <= cell["end_to_end_s"] and cell["pull_s"] > 0


def test_bench_params_measures_each_verify_mode_in_one_run(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sizes", "8MB", "--ranks", "1", "--instances", "1", "--repeats", "1",
                                      "--chunk-mb", "1", "--transports", "shm", "--verify", "auto,checksum", "--no-persist",
                                      "--output", str(output)])
    assert result.exit_code == 0, result.output
    size = json.loads(output.read_text())["sizes"][0]
    assert size["verify"] == ["auto", "checksum"] and size["memcpy"]["cpu_s"] > 0
    assert not size["persist"] and all(c["persist_s"] is None for c in size["cells"])
    assert [c["verify"] for c in size["cells"]] == ["auto", "checksum"]
    for cell in size["cells"]:
        assert cell["pull_cpu_s"] > 0 and cell["pull_cpu_vs_memcpy"] > 0 and cell["pull_vs_memcpy"] > 0
        assert cell["push_cpu_s"] > 0 and cell["push_cpu_vs_memcpy"] > 0


def test_bench_params_side_by_side_interleaves_memcpy_and_each_pull_mode(tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sizes", "8MB", "--side-by-side", "--verify", "auto,checksum",
                                      "--repeats", "2", "--chunk-mb", "1", "--output", str(output)])
    assert result.exit_code == 0, result.output
    (side,) = json.loads(output.read_text())["side_by_side"]
    assert set(side["runs"]) == {"memcpy", "pull auto", "pull checksum"} and side["rounds"] == 2
    assert all(len(times) == 2 for times in side["wall_s"].values())
    for row in side["runs"].values():
        assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["vs_memcpy"] > 0 and row["cpu_vs_memcpy"] > 0
    assert side["runs"]["memcpy"]["vs_memcpy"] == 1.0


def test_bench_params_refuses_unknown_verify_modes() -> None:
    result = CliRunner().invoke(app, ["bench", "params", "--verify", "auto,stamp"])
    assert result.exit_code != 0 and "choose from auto, checksum, none" in result.output


def test_bench_params_refuses_unknown_transports() -> None:
    result = CliRunner().invoke(app, ["bench", "params", "--transports", "carrier-pigeon"])
    assert result.exit_code != 0 and "choose from shm, http, nixl" in result.output


def test_a_pooled_size_moves_every_byte_through_shared_buffers(tmp_path: Path) -> None:
    """What runs when a size does not fit in memory: ranks and instances hold a ring of buffers
    (the pulls are verified, so every byte still matches), nothing is persisted."""
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--sizes", "24MiB", "--ranks", "2", "--instances", "1",
                                      "--repeats", "1", "--chunk-mb", "4", "--pool", "on", "--output", str(output)])
    assert result.exit_code == 0, result.output
    size = json.loads(output.read_text())["sizes"][0]
    assert size["pooled"] and not size["persist"] and size["memcpy"]["pooled"]
    assert {(c["transport"], c["persist_s"]) for c in size["cells"]} == {("shm", None), ("http", None)}
    assert all(c["pull_s"] > 0 and c["visible_vs_memcpy"] > 0 for c in size["cells"])


@pytest.mark.slow  # spawns a PS and two processes per rank count and table
def test_bench_params_measures_a_real_table_beside_its_synthetic_twin(tmp_path: Path) -> None:
    """``--model``: a MoE config's table of many small tensors, FSDP-split across two ranks,
    next to the synthetic table of the same bytes, compared cell by cell."""
    model = tmp_path / "tiny-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 32, "num_experts_per_tok": 2}))
    output = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "params", "--model", str(model), "--ranks", "2", "--instances", "1",
                                      "--repeats", "1", "--chunk-mb", "1", "--transports", "shm", "--output", str(output)])
    assert result.exit_code == 0, result.output
    real, twin = json.loads(output.read_text())["sizes"]
    assert real["table"] == "tiny-moe" and real["tensors"] > 200 and twin["table"] == "synthetic"
    assert twin["twin_of"] == "tiny-moe" and abs(twin["bytes"] - real["bytes"]) < 4096
    (cell,) = real["cells"]
    assert cell["vs_synthetic"]["push"] > 0 and cell["vs_synthetic"]["pull"] > 0
    assert 0 < cell["push_s"] <= cell["visible_s"] <= cell["end_to_end_s"]


@pytest.mark.slow  # spawns a PS and processes that import torch
def test_staged_device_legs_run_on_cpu_tensors(tmp_path: Path) -> None:
    """The ``--device cuda`` path (shards and parameters as device tensors behind one staging
    buffer, legs and copy bound measured) on CPU tensors, where no GPU is."""
    from staleflow.transports.bench import run_params_bench
    from staleflow.transports.tables import model_tensor_table

    table = model_tensor_table({"model_type": "qwen2", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "tie_word_embeddings": True})
    results = run_params_bench([], ["shm", "http"], [1, 2], [1], repeats=1, chunk_mb=1, models=[("tiny", table)],
                               synthetic_twins=False, device="cpu")
    (size,) = results["sizes"]
    bound = size["copy_bound"]
    assert bound["copy_bound_s"] == pytest.approx(bound["d2h_s"] + bound["memcpy_s"] + bound["h2d_s"])
    assert len(size["cells"]) == 4
    for cell in size["cells"]:
        assert cell["d2h_s"] > 0 and cell["h2d_s"] > 0 and cell["push_to_visible_s"] > 0
        assert cell["end_to_end_s"] >= cell["d2h_s"] and cell["end_to_end_vs_copy_bound"] > 0


def test_bench_params_explains_a_bad_model_or_device(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "params", "--model", str(tmp_path / "nothing")])
    assert result.exit_code != 0 and "give a directory holding config.json" in result.output
    result = CliRunner().invoke(app, ["bench", "params", "--device", "tpu"])
    assert result.exit_code != 0 and "choose cpu or cuda" in result.output
