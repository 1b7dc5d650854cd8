"""`staleflow up` with wrong settings, from flags or a config file: one message naming the field,
its flag and the fix; never a traceback, never a started job."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from staleflow.cli.main import app

CASES = [  # (flags, config file text or None, what the message must say)
    (["--eta", "-1"], None, ["ledger.eta (--eta)", "fix: set ledger.eta (--eta) to 0 or more"]),
    (["--group-size", "0"], None, ["ledger.group_size (--group-size)", "to 1 or more"]),
    (["--batch-size", "0"], None, ["ledger.batch_size (--batch-size)", "to 1 or more"]),
    (["--instances", "0"], None, ["instances (--instances)", "to 1 or more"]),
    (["--steps", "0"], None, ["steps (--steps)", "to 1 or more"]),
    (["--routing", "fast"], None, ["routing (--routing)", "one of 'throughput' or 'vanilla'"]),
    ([], "ledger:\n  eta: -2\n", ["ledger.eta (--eta)", "(got -2)", "0 or more"]),
    ([], "steps: many\n", ["steps (--steps): got 'many', which is not a whole number", "give steps (--steps) a whole number"]),
    ([], "ledger:\n  etta: 2\n", ["ledger.etta: unknown setting", "did you mean 'eta'?"]),
    ([], "flavour: blue\n", ["flavour: unknown setting", "the settings at the top level are", "max_tokens"]),
    ([], "ledger: 3\n", ["ledger", "LedgerConfig"]),
    ([], "trainer:\n  algorithm:\n    lr: 0\n", ["trainer.algorithm.lr:", "greater than 0", "more than 0"]),
    ([], "engine: sim\nkv_budget: 60\nmax_tokens: 20\n", ["sim KV budget (kv_budget, tokens) is 60", "longest prompt (51 tokens)",
                                           "lower max_tokens (--max-tokens) to at most 9", "raise kv_budget to at least 71"]),
    (["--max-tokens", "100"], "engine: sim\nkv_budget: 20\n", ["kv_budget", "raise kv_budget to at least 151"]),
    (["--engine", "vllm", "--max-tokens", "600"], None, ["vllm_args.max_model_len is 512",
                                                         "raise vllm_args.max_model_len to at least 601"]),
    (["--logger", "console,tensorbord"], None, ["logger.backends", "'tensorboard'", "(got 'tensorbord')"]),
    ([], "logger:\n  projekt: x\n", ["logger.projekt: unknown setting", "did you mean 'project'?"]),
    (["--max-tokens", "0"], None, ["trajectories.sampling.max_tokens (--max-tokens)", "to 1 or more"]),
    ([], "routin: vanilla\n", ["routin: unknown setting", "did you mean 'routing'?"]),
    ([], "coordinator:\n  strategy:\n    routin: vanilla\n", ["coordinator.strategy.routin: unknown setting",
                                                          "did you mean 'routing'?"]),
    ([], "coordinator:\n  strategy:\n    routing: fast\n", ["coordinator.strategy.routing (--routing)",
                                                           "one of 'throughput' or 'vanilla'"]),
    ([], "coordinator:\n  stall_timeout: -1\n", ["coordinator.stall_timeout:", "to 0.0 or more"]),
    ([], "params:\n  keep: 0\n", ["params.keep:", "to 1 or more"]),
    ([], "trainer:\n  remote_push: nixl\n", ["trainer.remote_push is 'nixl'", "offers http, shm",
                                              "add it to params.transports (e.g. [http, shm, nixl])"]),
    ([], "params:\n  port: 80\n", ["params.port: unknown setting", "the settings at params are", "keep"]),
    ([], "- a list\n", ["must hold a mapping of settings"]),
    ([], "steps: [unclosed\n", ["is not valid"]),
]


@pytest.mark.parametrize(("flags", "text", "expected"), CASES)
def test_wrong_settings_name_the_field_and_the_fix(tmp_path: Path, flags: list[str], text: str | None,
                                                   expected: list[str]) -> None:
    args = ["up", "--state-dir", str(tmp_path / "run"), *flags]
    if text is not None:
        (tmp_path / "job.yaml").write_text(text)
        args += ["--config", str(tmp_path / "job.yaml")]
    result = CliRunner().invoke(app, args)
    output = " ".join(result.output.split())  # rich wraps long lines
    assert result.exit_code == 2, output
    assert "Traceback" not in output and result.exception is None or isinstance(result.exception, SystemExit)
    assert output.startswith("error: invalid configuration") or "config file" in output, output
    for part in expected:
        assert part in output, (part, output)
    assert not (tmp_path / "run" / "endpoints.json").exists(), "nothing started"


def test_a_config_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    (tmp_path / "dir.yaml").mkdir()
    for path, expected in ((tmp_path / "dir.yaml", "cannot read config file"), (tmp_path / "no.yaml", "does not exist")):
        result = CliRunner().invoke(app, ["up", "--config", str(path), "--state-dir", str(tmp_path / "run")])
        assert result.exit_code == 2 and expected in " ".join(result.output.split()), result.output


def test_flags_override_a_wrong_file_value(tmp_path: Path) -> None:
    """The file's value is replaced by the flag's before validation: no error for a fixed field."""
    from staleflow.cli.up import job_config

    (tmp_path / "job.yaml").write_text("engine: sim\nledger:\n  eta: -1\nkv_budget: 60\nmax_tokens: 20\n")
    config = job_config(tmp_path / "job.yaml", eta=1, max_tokens=8)
    assert config.ledger.eta == 1 and config.max_tokens == 8 and config.kv_budget == 60
