"""A real job's model directory is checked before anything starts, each refusal with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from staleflow.launch.prepare import JobNotReady, check_model_directory


def test_a_directory_without_a_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JobNotReady) as refused:
        check_model_directory(tmp_path)
    assert refused.value.message == f"model {tmp_path} has no config.json"
    assert "--model" in refused.value.fix


def test_a_model_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(JobNotReady) as refused:
        check_model_directory(tmp_path)
    assert refused.value.message == f"model {tmp_path} has no tokenizer.json"
    assert "tokenizer" in refused.value.fix


def test_a_tokenizer_that_fits_the_vocabulary_passes(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    check_model_directory(tmp_path)
