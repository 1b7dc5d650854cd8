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
