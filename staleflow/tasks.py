"""Prompt sources: the built-in generated task set and user datasets (JSONL or Parquet).

A prompt is text plus a verifiable answer. The built-in task needs no files: multi-digit
arithmetic with exact answers, generated from a seed, so the default run downloads nothing."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    answer: str


@dataclass
class SkippedRows:
    """Rows a dataset could not use, with the reason, so a run reports them instead of crashing."""

    count: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.count += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class ArithmeticTask:
    """Endless multi-digit arithmetic problems; the i-th prompt is a pure function of (seed, i)."""

    name = "arithmetic"

    def __init__(self, seed: int = 0, digits: int = 3, ops: str = "+-*"):
        if digits < 1:
            raise ValueError("digits must be >= 1")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty combination of '+', '-' and '*', got {ops!r}")
        self.seed = seed
        self.digits = digits
        self.ops = ops

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        hi = 10**self.digits - 1
        a, b = rng.randint(1, hi), rng.randint(1, hi)
        op = rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        text = f"Compute {a} {op} {b}. Put the final answer in \\boxed{{}}."
        return Prompt(index, text, str(value))

    @staticmethod
    def longest_prompt_tokens(digits: int) -> int:
        """Tokens (``ByteTokenizer``) of the longest prompt ``prompt`` can make with ``digits``."""
        widest = "9" * digits
        return len(ByteTokenizer().encode(f"Compute {widest} * {widest}. Put the final answer in \\boxed{{}}."))

    def __iter__(self) -> Iterator[Prompt]:
        index = 0
        while True:
            yield self.prompt(index)
            index += 1


class DatasetPrompts:
    """Prompts from a JSONL or Parquet file with a prompt field and an answer field, cycled."""

    def __init__(self, path: Path, prompt_field: str = "prompt", answer_field: str = "answer",
                 max_prompt_chars: int | None = None):
        self.path = Path(path)
        self.skipped = SkippedRows()
        self.rows = [
            Prompt(i, text, answer)
            for i, (text, answer) in enumerate(self._read(prompt_field, answer_field, max_prompt_chars))
        ]
        if not self.rows:
            raise ValueError(
                f"{self.path}: no usable rows (need fields {prompt_field!r} and {answer_field!r}); "
                f"skipped {self.skipped.count}: {self.skipped.reasons}"
            )

    def _read(self, prompt_field: str, answer_field: str, max_chars: int | None) -> Iterator[tuple[str, str]]:
        for row in self._records():
            if not isinstance(row, dict):
                self.skipped.add("not an object")
                continue
            text, answer = row.get(prompt_field), row.get(answer_field)
            if not isinstance(text, str) or not text.strip():
                self.skipped.add(f"missing {prompt_field}")
            elif answer is None or str(answer).strip() == "":
                self.skipped.add(f"missing {answer_field}")
            elif max_chars is not None and len(text) > max_chars:
                self.skipped.add("prompt too long")
            else:
                yield text, str(answer)

    def _records(self) -> Iterator[object]:
        if not self.path.exists():
            raise FileNotFoundError(f"dataset {self.path} does not exist")
        if self.path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq  # pyright: ignore[reportMissingImports]  (optional: parquet task files)
            except ImportError as exc:
                raise RuntimeError("reading Parquet needs pyarrow: pip install pyarrow") from exc
            yield from pq.read_table(self.path).to_pylist()
            return
        with self.path.open("rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line.decode())
                except UnicodeDecodeError:
                    self.skipped.add("not UTF-8")
                except json.JSONDecodeError:
                    self.skipped.add("invalid JSON")

    def prompt(self, index: int) -> Prompt:
        row = self.rows[index % len(self.rows)]
        return Prompt(index, row.text, row.answer)


class ByteTokenizer:
    """UTF-8 bytes as token ids (offset past three special ids). Real and lossless, for the
    simulated engine and tests; real runs use the model's own tokenizer."""

    pad_id, bos_id, eos_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + self.offset for b in text.encode()]

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size).decode(errors="replace")


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` (the model's own tokenizer), through the light
    ``tokenizers`` library: no transformers import in the trajectory server."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise RuntimeError("a model tokenizer needs the tokenizers package: pip install 'staleflow[train]'") from exc
        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}: point tokenizer at the model directory")
        self._tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
