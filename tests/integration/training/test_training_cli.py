"""The trainer's CLI around real runs: reward curves compared across runs, model checks."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.training.role import StepLog, StepRecord


def _run(directory: Path, eta: int, rewards: list[float]) -> Path:
    (directory / "trainer").mkdir(parents=True)
    (directory / "job.json").write_text(json.dumps({"ledger": {"eta": eta}}))
    log = StepLog(directory / "trainer" / "steps.jsonl")
    for v, r in enumerate(rewards):
        log.append(StepRecord(v, float(v), 2, 16, 100, r, 6.0, 8, {eta: 16}, 1.0, {"loss": 0.1}))
    with (directory / "trainer" / "steps.jsonl").open("a") as f:
        f.write('{"version": 99, "torn')  # a trainer killed mid-write leaves a torn last line
    return directory


def test_rewards_compares_runs_and_skips_a_torn_line(tmp_path: Path) -> None:
    a = _run(tmp_path / "eta0", 0, [0.1] * 5 + [0.3] * 5)
    b = _run(tmp_path / "eta2", 2, [0.1] * 10)
    out = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["rewards", str(a), str(b), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["runs"]["eta0 (eta = 0)"] == [0.1] * 5 + [0.3] * 5 and len(doc["runs"]["eta2 (eta = 2)"]) == 10
    assert out.stat().st_size > 0
    table = CliRunner().invoke(app, ["rewards", str(a), "--out", str(out)])
    assert "+0.200" in table.output


def test_rewards_names_a_directory_without_steps(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["rewards", str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "no trained steps" in " ".join(result.output.split())


def test_a_retrained_step_replaces_its_first_record(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "steps.jsonl")
    first = StepRecord(0, 1.0, 1, 8, 10, 0.0, 1.0, 2, {0: 8}, 1.0)
    log.append(first)
    log.append(StepRecord(**{**asdict(first), "mean_reward": 0.5}))
    assert [s.mean_reward for s in log.read()] == [0.5]


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    result = CliRunner().invoke(app, ["up", "--model", str(tmp_path), "--state-dir", str(tmp_path / "run")])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "has 50 tokens but the model's vocabulary is 10" in output, output
