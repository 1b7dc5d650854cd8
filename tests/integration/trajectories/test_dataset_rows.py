"""A dataset with bad rows: the TS skips them with a count and a reason, serves the good ones, and
the count shows in its health and in `staleflow status`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from support import manager_config
from typer.testing import CliRunner

from staleflow.cli.main import app
from staleflow.config import LedgerConfig
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

GOOD = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]


def write_dataset(path: Path) -> Path:
    lines = [json.dumps(r).encode() for r in GOOD] + [
        json.dumps({"answer": "1"}).encode(),                          # no prompt
        json.dumps({"prompt": "   ", "answer": "1"}).encode(),         # a blank prompt
        json.dumps({"prompt": "What is 1 + 1?"}).encode(),             # no answer
        json.dumps({"prompt": "What is 1 + 1?", "answer": ""}).encode(),
        json.dumps(["a list", "not an object"]).encode(),
        b"{not json",
        b'{"prompt": "caf\xe9", "answer": "1"}',                       # Latin-1, not UTF-8
        json.dumps({"prompt": "x" * 500, "answer": "1"}).encode(),     # over max_prompt_chars
        json.dumps({"prompt": "y" * 100, "answer": "1"}).encode(),     # over max_prompt_tokens only
        b"",
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_are_skipped_counted_and_reported(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "prompts.jsonl")
    ledger = LedgerConfig(eta=1, batch_size=2, group_size=1)
    with serve_in_thread(manager_app(manager_config(tmp_path, eta=1, batch_size=2))) as manager, \
            serve_in_thread(ts_app(TrajectoryServerConfig(
                ledger=ledger, manager_url=manager.url, state_dir=tmp_path, dataset=dataset, reward="sim",
                max_prompt_chars=200, max_prompt_tokens=64, sampling=SamplingConfig(max_tokens=8)))) as ts:
        health = httpx.get(f"{ts.url}/v1/health").json()
        skipped = health["skipped_prompts"]
        assert skipped["reasons"] == {"missing prompt": 2, "missing answer": 2, "not an object": 1, "invalid JSON": 1,
                                      "not UTF-8": 1, "prompt too long": 1,
                                      "prompt longer than 64 tokens": 1}, skipped
        assert skipped["count"] == 9
        # only good rows are sampled, and the dataset cycles without counting a long row twice
        pending = httpx.get(f"{ts.url}/v1/pending").json()["trajectories"]
        assert pending, "the good rows are served"
        texts = {httpx.get(f"{ts.url}/v1/trajectories/{t['traj_id']}").json()["prompt_text"] for t in pending}
        assert texts <= {r["prompt"] for r in GOOD}
        assert httpx.get(f"{ts.url}/v1/health").json()["skipped_prompts"]["count"] == 9

        state = tmp_path / "job"
        state.mkdir()
        (state / "endpoints.json").write_text(json.dumps({"ts": {"url": ts.url}, "manager": {"url": manager.url}}))
        shown = CliRunner().invoke(app, ["status", "--state-dir", str(state)], env={"COLUMNS": "250"})
        assert shown.exit_code == 0, shown.output
        assert "9 prompts skipped" in shown.output
        verbose = CliRunner().invoke(app, ["status", "--state-dir", str(state), "--verbose"], env={"COLUMNS": "250"})
        assert verbose.exit_code == 0, verbose.output
        assert "skipped prompts: 9" in verbose.output and "2 missing answer" in " ".join(verbose.output.split())
        as_json = CliRunner().invoke(app, ["status", "--state-dir", str(state), "--json"])
        assert json.loads(as_json.output)["ts"]["health"]["skipped_prompts"]["count"] == 9


def test_a_dataset_with_no_usable_row_names_the_fields(tmp_path: Path) -> None:
    import pytest

    from staleflow.tasks import DatasetPrompts

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "solution": "s"}) + "\n")
    with pytest.raises(ValueError, match="no usable rows .*'prompt' and 'answer'.*missing prompt"):
        DatasetPrompts(path)
