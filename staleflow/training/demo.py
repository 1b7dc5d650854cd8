"""The demo policy: a tiny Qwen2 built here, a tokenizer trained here, a short supervised warm-up.

Nothing is downloaded. ``build_demo_model`` trains a BPE tokenizer (single-digit tokens, so numbers
are spelled digit by digit) on the task's prompts and answers, builds a small randomly
initialised Qwen2 from a config, and fine-tunes it on ``(prompt, \\boxed{answer})`` pairs for a
few hundred steps: enough to learn the answer format and some of the arithmetic, not all of it,
so RL has a reward to raise. The directory it writes is a normal Hugging Face model directory
(config, safetensors, tokenizer) that vLLM and ``transformers`` load as they load any model.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from staleflow.tasks import ArithmeticTask

EOS, PAD = "<|endoftext|>", "<|pad|>"
MARKER = "demo.json"  # written last: a directory without it is an unfinished build


@dataclass(frozen=True)
class DemoSpec:
    """What the demo model is; the directory is rebuilt when any of this changes."""

    digits: int = 1
    ops: str = "+"
    vocab_size: int = 384
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 384
    # the warm-up answers directly (``\\boxed{sum}``) in a share ``concise_fraction`` of its
    # examples; the others are worked answers that open their box only past the job's response
    # budget (``RESPONSE_BUDGET``): a habit RL has to unlearn
    concise_fraction: float = 0.25
    sft_steps: int = 400
    sft_batch: int = 48
    sft_lr: float = 3e-3
    seed: int = 0

    def task(self, seed: int | None = None) -> ArithmeticTask:
        return ArithmeticTask(self.seed if seed is None else seed, digits=self.digits, ops=self.ops)


def response_text(answer: str) -> str:
    """The concise answer: what the verifier rewards, in a few tokens."""
    return f"\\boxed{{{answer}}}"


_PROBLEM = re.compile(r"Compute (\d+) ([-+*]) (\d+)\.")


def worked_text(prompt_text: str, answer: str) -> str:
    """A worked-out answer: the problem restated, then the boxed result. It takes more tokens than
    the job's response budget (24) before the box opens, so a sampled one is cut off with no
    answer: reward 0 (its last number is an operand's digit)."""
    match = _PROBLEM.search(prompt_text)
    if match is None:
        raise ValueError(f"not a task prompt: {prompt_text!r}")
    a, op, b = match.groups()
    spell = " ".join
    return (f"Let me work it out digit by digit: the first number {a} is {spell(a)} and the second number "
            f"{b} is {spell(b)}, so {a} {op} {b} gives {response_text(answer)}")


def warmup_response(prompt_text: str, answer: str, rng: random.Random, concise_fraction: float) -> str:
    """One warm-up target: concise with probability ``concise_fraction``, else a worked solution."""
    return response_text(answer) if rng.random() < concise_fraction else worked_text(prompt_text, answer)


def demo_ready(directory: Path, spec: DemoSpec) -> bool:
    marker = directory / MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()).get("spec") == asdict(spec)
    except ValueError:
        return False


def demo_config(spec: DemoSpec, tokenizer):  # -> transformers.Qwen2Config
    """The demo model's architecture (what a step costs depends on it alone, not on the weights)."""
    import transformers

    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if not isinstance(eos_id, int) or not isinstance(pad_id, int):
        raise ValueError(f"the demo tokenizer has no single eos and pad token (eos {eos_id!r}, pad {pad_id!r})")
    return transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=512, tie_word_embeddings=True, dtype="float32",
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)


def build_demo_model(directory: Path, spec: DemoSpec = DemoSpec(),
                     progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Writes the demo model into ``directory``; returns what it measured (SFT loss, accuracy)."""
    import torch

    report = progress or (lambda what, done, total: None)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).unlink(missing_ok=True)
    # one thread: a model this small gains little from two, and on a busy 2-core machine two
    # threads made steps 2-50x slower (0.2 s vs 0.3-12 s measured) through OpenMP contention
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build(directory, spec, report)
    finally:
        torch.set_num_threads(threads)


def _build(directory: Path, spec: DemoSpec, report: Callable[[str, int, int], None]) -> dict:
    import torch
    import transformers

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    task = spec.task(seed=spec.seed + 10_000)  # SFT prompts: another stream than the RL prompts (seed 0..)

    report("tokenizer", 0, 1)
    tokenizer = train_tokenizer(task, spec.vocab_size)
    tokenizer.save_pretrained(directory)
    report("tokenizer", 1, 1)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if not isinstance(eos_id, int) or not isinstance(pad_id, int):
        raise ValueError(f"the demo tokenizer has no single eos and pad token (eos {eos_id!r}, pad {pad_id!r})")

    model = transformers.Qwen2ForCausalLM(demo_config(spec, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, spec.sft_steps) / spec.sft_steps)))
    losses = []
    started = time.perf_counter()
    model.train()
    for step in range(spec.sft_steps):
        prompts = [task.prompt(rng.randrange(1 << 30)) for _ in range(spec.sft_batch)]
        ids, labels, attention = sft_batch(
            tokenizer, [(p.text, warmup_response(p.text, p.answer, rng, spec.concise_fraction)) for p in prompts])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        report("supervised warm-up", step + 1, spec.sft_steps)
    model.eval()
    start = starting_point(model, tokenizer, spec.task(seed=spec.seed + 20_000), 256, seed=spec.seed)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory, safe_serialization=True)
    result = {
        "spec": asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_seconds": time.perf_counter() - started,
        "sft_loss_first": losses[0] if losses else None,
        "sft_loss_last": sum(losses[-10:]) / max(1, len(losses[-10:])),
        **start,
    }
    (directory / MARKER).write_text(json.dumps(result, indent=2))
    return result


def train_tokenizer(task: ArithmeticTask, vocab_size: int):
    """A byte-level BPE trained on the task's text, with every digit its own token."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = []
    for i in range(4000):
        p = task.prompt(i)
        corpus.append(p.text + " " + response_text(p.answer))
        corpus.append(worked_text(p.text, p.answer))
    tokenizer.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD,
                                                model_max_length=512)


def sft_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Right-padded (input ids, labels with the prompt masked, attention mask)."""
    import torch

    rows, targets = [], []
    for prompt, response in pairs:
        p = tokenizer.encode(prompt)
        r = tokenizer.encode(response) + [tokenizer.eos_token_id]
        rows.append(p + r)
        targets.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets, strict=True)):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(target)] = torch.tensor(target)
        attention[i, :len(row)] = 1
    return ids, labels, attention


RESPONSE_BUDGET = 24  # the default job's max_tokens: worked answers do not fit in it


def starting_point(model, tokenizer, task: ArithmeticTask, n: int, budget: int = RESPONSE_BUDGET,
                   seed: int = 0) -> dict[str, float]:
    """Where RL starts, on ``n`` fresh problems: the mean reward of one sample each at temperature 1
    within ``budget`` tokens (what the first training steps see), the share of samples that answer
    directly, and the greedy accuracy of the arithmetic itself (the response forced to open with
    ``\\boxed{``). Batched by prompt length, so no padding is involved."""
    import torch

    from staleflow.rewards import verify_math

    by_length: dict[int, list] = {}
    for i in range(n):
        p = task.prompt(i)
        ids = tokenizer.encode(p.text)
        by_length.setdefault(len(ids), []).append((ids, p.answer))
    opening = response_text("")[:-1]  # "\\boxed{"
    opened = tokenizer.encode(opening)
    reward = concise = correct = 0.0
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for length, items in by_length.items():
            ids = torch.tensor([row for row, _ in items])
            torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=generator)))
            sampled = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
            for row, (_, answer) in zip(sampled[:, length:], items, strict=True):
                text = tokenizer.decode(row, skip_special_tokens=True)
                reward += verify_math(text, answer)[0]
                concise += text.lstrip().startswith(opening)
            forced = torch.tensor([row + opened for row, _ in items])
            greedy = model.generate(forced, attention_mask=torch.ones_like(forced), max_new_tokens=12, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            for row, (_, answer) in zip(greedy[:, forced.shape[1]:], items, strict=True):
                correct += verify_math(opening + tokenizer.decode(row, skip_special_tokens=True), answer)[0] > 0
    return {"sampled_reward": reward / n, "concise_share": concise / n, "boxed_greedy_accuracy": correct / n}


def demo_dir(spec: DemoSpec = DemoSpec()) -> Path:
    """Where the demo model lives: ``$STALEFLOW_CACHE`` or ``~/.cache/staleflow``, one directory
    per spec, so every job (and every test) on the machine shares one build."""
    import hashlib
    import os

    root = Path(os.environ.get("STALEFLOW_CACHE") or Path.home() / ".cache" / "staleflow")
    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:10]
    return root / f"demo-qwen2-{digest}"


def ensure_demo_model(spec: DemoSpec = DemoSpec(),
                      progress: Callable[[str, int, int], None] | None = None) -> tuple[Path, dict]:
    """The demo model's directory, built first if it is missing or unfinished."""
    import fcntl

    directory = demo_dir(spec)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent jobs: one builds, the others wait for it
        if not demo_ready(directory, spec):
            build_demo_model(directory, spec, progress)
    return directory, json.loads((directory / MARKER).read_text())


def resolve_model(config) -> Path:
    """The job's model directory: its own, or the demo model (which must have been built)."""
    if config.model is not None:
        if not (Path(config.model) / "config.json").exists():
            raise FileNotFoundError(f"model {config.model} has no config.json: give a local Hugging Face model directory")
        return Path(config.model)
    spec = demo_spec(config)
    directory = demo_dir(spec)
    if not demo_ready(directory, spec):
        raise FileNotFoundError(f"the demo model is not built at {directory}: run `staleflow init-demo`")
    return directory


def demo_spec(config) -> DemoSpec:
    """The demo model for the job's task."""
    return DemoSpec(digits=config.task.digits, ops=config.task.ops)
