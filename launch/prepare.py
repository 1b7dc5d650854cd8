"""What a real (vLLM) job needs before anything starts: its packages, and a model directory that
vLLM, the trainer and the trajectory server can all use. Each problem is a ``JobNotReady``: what is
wrong, and the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from staleflow.config.compose import model_vocab_size

REAL_JOB_PACKAGES = ("vllm", "torch", "transformers")


class JobNotReady(RuntimeError):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def check_real_job_packages() -> None:
    missing = [m for m in REAL_JOB_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise JobNotReady(f"the vllm engine needs {', '.join(missing)}, which are not installed",
                          "pip install -e '.[vllm,train]' && pip uninstall -y torchvision torchaudio torchcodec triton "
                          "(see the README), or run a simulated cluster with --engine sim")


def check_model_directory(model: Path) -> None:
    """A config, and a tokenizer whose ids fit the model's vocabulary (else every rollout would be refused)."""
    if not (model / "config.json").exists():
        raise JobNotReady(f"model {model} has no config.json", "give a local Hugging Face model directory with --model")
    if not (model / "tokenizer.json").exists():
        raise JobNotReady(f"model {model} has no tokenizer.json",
                          "save the model's (fast) tokenizer into the same directory")
    from staleflow.tasks import HfTokenizer

    vocab = model_vocab_size(model)
    tokens = HfTokenizer(model).vocab_size
    if isinstance(vocab, int) and tokens > vocab:
        raise JobNotReady(f"the tokenizer in {model} has {tokens} tokens but the model's vocabulary is {vocab}: they "
                          "do not belong together", "save the tokenizer the model was trained with into the model directory")
