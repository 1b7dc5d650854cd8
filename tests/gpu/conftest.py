"""The ``gpu`` tier: tests that need CUDA, skipped where torch sees no GPU (CI never has one).

The model is tiny by default; ``STALEFLOW_GPU_TEST_MODEL`` names a Hugging Face model directory
or a ``config.json`` (random init) to run the same tests on a real shape, e.g. Qwen2.5-1.5B's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the gpu tier needs torch")
transformers = pytest.importorskip("transformers", reason="the gpu tier needs transformers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: the gpu tier runs on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = {"vocab_size": 151_936, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "max_position_embeddings": 4096, "model_type": "qwen2"}


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: STALEFLOW_GPU_TEST_MODEL's (a directory as is; a config.json randomly
    initialised and saved), else a tiny Qwen2 with the real 151,936 vocabulary."""
    named = os.environ.get("STALEFLOW_GPU_TEST_MODEL")
    if named and Path(named).is_dir():
        return Path(named)
    if named:
        config = transformers.AutoConfig.from_pretrained(named)
    else:
        config = transformers.Qwen2Config(**{k: v for k, v in TINY.items() if k != "model_type"})
    directory = tmp_path_factory.mktemp("gpu-model")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory
