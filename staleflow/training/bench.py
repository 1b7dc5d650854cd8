"""``staleflow bench trainer``: the FSDP2 trainer on a synthetic GRPO batch, measured.

It trains ``steps`` steps of one synthetic batch with ``FsdpBackend`` (its constructor,
``train(version, batch)`` and its head timer, nothing else), on ``world_size`` ranks (processes:
gloo on CPU, NCCL on GPU, one rank per GPU), and reports per-step seconds, the log-prob head's
share of them, trained tokens per second, the state's and the activations' memory and, on a GPU,
the model FLOP utilisation (MFU).

The model is a Hugging Face directory with weights, or a ``config.json`` (or a directory holding
only one) of any causal LM that transformers knows: then the weights are random, built from the
config on the fastest device here and saved once, in bf16, into a temporary directory the trainer
loads as it would load a real model. Nothing is downloaded.

The batch (``synthetic_batch``): ``batch`` trajectories in groups of ``group_size`` sharing a prompt
of ``prompt_tokens`` random token ids; responses of random ids whose lengths follow
``response_dist``:

* ``uniform``: every response is ``response_tokens`` long;
* ``longtail``: ``ceil(batch / 16)`` responses (at least one) are ``response_tokens`` long, at
  positions chosen at random; every other response's length is drawn uniformly from
  ``[response_tokens / 64, response_tokens / 8]`` (at least one token). Seeded: the same flags give
  the same batch.

Rewards are 0 or 1 at random, behaviour log-probs uniform in [-3, 0].

The numbers (``run`` returns them; the CLI prints them as JSON):

* ``steps``: seconds of each step, rank 0 (the ranks are in lockstep: every step ends with
  collectives), the device synchronised before and after;
* ``tokens_per_s``: trained tokens (prompt + response, no padding) per second, over the steps after
  the first (the first compiles, allocates and warms the allocator; with one step, that one);
* ``mfu``: ``6 x params x tokens_per_s / (peak_tflops x 1e12 x world_size)``; the 6N estimate leaves
  out attention's quadratic term and the frozen reference model's forward (``kl_coef > 0``); null
  without a peak (CPU, or a GPU the table does not know: give ``--peak-tflops``);
* ``head_seconds``, ``head_share``: rank 0's seconds inside the log-prob head per step (its forward
  and backward: a timer around it, CUDA events on a GPU), and their share of the step, over the
  steps after the first;
* ``token_budget``: ``max_tokens_per_micro_batch`` as the trainer resolved it (``auto``: the memory
  model's budget on a GPU, none on CPU);
* ``state_bytes``: parameters + gradients + optimizer state of every rank together (gradients as
  the trainable parameters' shards; they exist from the backward to the optimizer step);
* ``peak_memory_bytes``: the largest per-rank peak during the steps: allocated device memory on a
  GPU, the process's resident set (RSS) on CPU;
* ``activation_peak_bytes``: that peak minus the memory in use once the model was built minus the
  gradients and optimizer state that live on the device; on a GPU this is the peak minus the state,
  on CPU it also leaves out the interpreter and libraries that the RSS holds.

The trainer role reports the same per-step numbers (``staleflow.training.metering.MeteredBackend``)
into the job's tracking.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from staleflow.config import TrainerConfig
from staleflow.host import meminfo_bytes
from staleflow.ports import free_port
from staleflow.training.metering import SectionTimer, StepMeter, model_flops_utilization, trained_tokens

RESPONSE_DISTRIBUTIONS = ("uniform", "longtail")
LONGTAIL_AT_MAX_EVERY = 16
"""longtail: one response in this many (rounded up, at least one) is ``response_tokens`` long."""
LONGTAIL_SHORT_RANGE = (1 / 64, 1 / 8)
"""longtail: the other responses' lengths, as fractions of ``response_tokens`` (uniform between)."""

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


class BenchInputError(ValueError):
    """Input the benchmark cannot run with: what is wrong, and the fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


@dataclass(frozen=True)
class BenchSpec:
    model: Path
    batch: int = 8
    prompt_tokens: int = 32
    response_tokens: int = 96
    response_dist: str = "uniform"
    steps: int = 3
    world_size: int = 1
    group_size: int = 8
    peak_tflops: float | None = None
    seed: int = 0
    trainer: dict[str, Any] = field(default_factory=dict)
    """TrainerConfig settings (nested as in a job file's ``trainer`` section); world_size is ours."""

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig.model_validate({**self.trainer, "world_size": self.world_size})


# ------------------------------------------------------------------------------ the batch


def response_lengths(batch: int, response_tokens: int, distribution: str, seed: int = 0) -> list[int]:
    if distribution == "uniform":
        return [response_tokens] * batch
    if distribution != "longtail":
        raise BenchInputError(f"response distribution {distribution!r} is unknown",
                              f"use one of {', '.join(RESPONSE_DISTRIBUTIONS)}")
    rng = random.Random(seed)
    low, high = (max(1, round(response_tokens * f)) for f in LONGTAIL_SHORT_RANGE)
    lengths = [rng.randint(low, high) for _ in range(batch)]
    for i in rng.sample(range(batch), max(1, math.ceil(batch / LONGTAIL_AT_MAX_EVERY))):
        lengths[i] = response_tokens
    return lengths


def synthetic_batch(spec: BenchSpec, vocab_size: int) -> dict[str, Any]:
    """A trajectory server's batch document: groups sharing a prompt, random ids and rewards."""
    rng = random.Random(spec.seed)
    lengths = response_lengths(spec.batch, spec.response_tokens, spec.response_dist, spec.seed)
    trajectories, prompt = [], []
    for i, n in enumerate(lengths):
        if i % spec.group_size == 0:
            prompt = [rng.randrange(vocab_size) for _ in range(spec.prompt_tokens)]
        trajectories.append({
            "group_id": f"g{i // spec.group_size}", "prompt_ids": prompt,
            "tokens": [rng.randrange(vocab_size) for _ in range(n)],
            "logprobs": [-3.0 * rng.random() for _ in range(n)],
            "reward": float(rng.random() < 0.5), "v_traj": 0,
        })
    groups = sorted({t["group_id"] for t in trajectories})
    return {"version": 0, "groups": groups, "trajectories": trajectories}


# ------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    """What the trainer loads: the given directory, or the random weights written from the config."""
    architecture: str
    parameters: int
    vocab_size: int
    random_init: bool


def inspect_model(path: Path) -> tuple[Any, str, int, bool]:
    """(config, architecture, parameter count, has weights) of a model directory or config.json,
    built on the meta device (no memory, no download). Bad input raises ``BenchInputError``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path.exists():
        raise BenchInputError(f"model path {path} does not exist",
                              "give --model a Hugging Face model directory or a config.json")
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise BenchInputError(f"{path} holds no config.json", "give --model a Hugging Face model directory or a config.json")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"{config_file} is not readable JSON ({exc})", "give --model a Hugging Face config.json") from None
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    if not model_type:
        raise BenchInputError(f"{config_file} names no model_type", "use a Hugging Face config.json (it has \"model_type\")")
    try:
        config = AutoConfig.for_model(**settings)
    except (KeyError, ValueError) as exc:
        raise BenchInputError(f"{config_file}: model_type {model_type!r} is not an architecture transformers "
                              f"{transformers.__version__} knows ({exc})",
                              "use a config.json of an architecture this transformers knows, or upgrade transformers") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (KeyError, ValueError, ImportError) as exc:
        raise BenchInputError(f"{config_file}: {type(config).__name__} is not a causal LM transformers can build ({exc})",
                              "use the config.json of a causal (decoder) language model") from None
    if not hasattr(getattr(model, "model", None), "layers"):
        raise BenchInputError(f"{config_file}: {type(model).__name__} has no model.layers, which the FSDP2 trainer "
                              "shards one by one", "use a decoder LM with model.layers (Llama, Qwen2, Mistral, ...)")
    parameters = sum(p.numel() for p in model.parameters())
    has_weights = path.is_dir() and any(any(path.glob(pattern)) for pattern in WEIGHT_FILES)
    return config, type(model).__name__, parameters, has_weights


HOST_BYTES_PER_PARAMETER = 20
"""What the host holds per parameter when the state lives there (CPU training, or optimizer offload
on a GPU): fp32 parameter, gradient and AdamW's two moments (16 bytes), plus the temporaries of the
optimizer step on CPU (its foreach kernels allocate parameter-sized intermediates)."""


def check_host_memory(parameters: int, cfg: TrainerConfig, on_cuda: bool, available: int | None = None) -> None:
    """On CPU, or with optimizer offload, the whole state is in this machine's memory (all ranks
    together): refuse a run that cannot fit instead of being killed by the kernel halfway."""
    if on_cuda and not getattr(cfg, "optimizer_offload", False):
        return
    if available is None:
        available = _meminfo_bytes("MemAvailable")
    needed = HOST_BYTES_PER_PARAMETER * parameters
    if needed > available:
        where = "with optimizer offload" if on_cuda else "on CPU"
        raise BenchInputError(
            f"{where} the trainer keeps its whole state in host memory: {needed / 2**30:.1f} GiB "
            f"({HOST_BYTES_PER_PARAMETER} bytes x {parameters:,} parameters with the optimizer step's temporaries), "
            f"more than the {available / 2**30:.1f} GiB this machine has available",
            "use a machine with more memory, a smaller model, or GPUs without optimizer offload")


def _meminfo_bytes(key: str) -> int:
    found = meminfo_bytes(key)
    if found is None:
        raise RuntimeError(f"/proc/meminfo has no {key}")
    return found


def prepare_model(path: Path, scratch: Path, cfg: TrainerConfig) -> ModelSource:
    """The model to train: ``path`` if it has weights, else random bf16 weights from its config,
    initialised as transformers initialises the architecture and saved into ``scratch``."""
    import torch
    from transformers import AutoModelForCausalLM

    from staleflow.training.attention import packing_for

    config, architecture, parameters, has_weights = inspect_model(path)
    check_host_memory(parameters, cfg, torch.cuda.is_available())
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:  # packing: true on attention that cannot take packed rows, refused before any rank starts
        with torch.device("meta"):
            packing_for(AutoModelForCausalLM.from_config(config), cfg.packing, device)
    except ValueError as exc:
        raise BenchInputError(str(exc), "change --set packing") from None
    quiet_transformers()
    if has_weights:
        return ModelSource(path, architecture, parameters, int(config.vocab_size), random_init=False)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(scratch, safe_serialization=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ModelSource(scratch, architecture, parameters, int(config.vocab_size), random_init=True)


def quiet_transformers() -> None:
    """No per-file progress bars of transformers' saving and loading between the benchmark's output."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


# ------------------------------------------------------------------------------ memory and time


def _local_bytes(tensor: Any) -> tuple[int, Any]:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size(), local.device


def state_bytes(backend: Any) -> dict[str, int]:
    """This rank's parameters (policy and reference), gradients (one per trainable parameter, as
    its shard) and optimizer state, in bytes, and how much of it lives on the trainer's device."""
    totals = {"parameters": 0, "gradients": 0, "optimizer": 0, "on_device": 0, "parameters_on_device": 0}
    modules = [backend.model] + ([backend.reference] if getattr(backend, "reference", None) is not None else [])
    for module in modules:
        for p in module.parameters():
            nbytes, device = _local_bytes(p)
            on_device = nbytes if device.type == backend.device.type else 0
            totals["parameters"] += nbytes
            totals["parameters_on_device"] += on_device
            totals["on_device"] += on_device
            if p.requires_grad:  # the gradient's shard: the parameter's size and device
                totals["gradients"] += nbytes
                totals["on_device"] += on_device
    for per_param in backend.optimizer.state.values():
        for value in per_param.values():
            if hasattr(value, "numel"):
                nbytes, device = _local_bytes(value)
                totals["optimizer"] += nbytes
                totals["on_device"] += nbytes if device.type == backend.device.type else 0
    totals["total"] = totals["parameters"] + totals["gradients"] + totals["optimizer"]
    return totals


# ------------------------------------------------------------------------------ the run


ProgressCallback = Callable[[str, int, int], None]
"""(phase, done, total): ``model`` (0/1, 1/1), ``load`` (0/1, 1/1), ``step`` (k/steps)."""


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


def check_spec(spec: BenchSpec) -> TrainerConfig:
    """Input errors that need no model, before anything starts."""
    for name in ("batch", "prompt_tokens", "response_tokens", "steps", "world_size", "group_size"):
        if getattr(spec, name) < 1:
            raise BenchInputError(f"--{name.replace('_', '-')} is {getattr(spec, name)}", f"give --{name.replace('_', '-')} 1 or more")
    if spec.response_dist not in RESPONSE_DISTRIBUTIONS:
        raise BenchInputError(f"--response-dist {spec.response_dist!r} is unknown",
                              f"use one of {', '.join(RESPONSE_DISTRIBUTIONS)}")
    if spec.peak_tflops is not None and spec.peak_tflops <= 0:
        raise BenchInputError(f"--peak-tflops is {spec.peak_tflops}", "give the GPU's dense bf16 peak in TFLOP/s, above 0")
    cfg = spec.trainer_config()
    budget = _token_budget(cfg)
    if budget is not None and budget < spec.prompt_tokens:
        raise BenchInputError(f"the token budget per micro-batch ({budget}) is smaller than the prompt "
                              f"({spec.prompt_tokens} tokens): no micro-batch could hold one trajectory",
                              f"raise max_tokens_per_micro_batch to at least {spec.prompt_tokens}, or lower --prompt-tokens")
    import torch

    from staleflow.training.fsdp import resolve_settings

    try:  # the settings this machine cannot honour (fused_kernels: true without CUDA and Liger, ...)
        resolve_settings(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as exc:
        raise BenchInputError(str(exc), "change that --set value") from None
    if torch.cuda.is_available():
        check_ranks_fit(spec.world_size, torch.cuda.device_count())
    return cfg


def check_ranks_fit(world_size: int, gpus: int) -> None:
    """One rank per GPU: more ranks than this machine's GPUs cannot start."""
    if world_size > gpus:
        raise BenchInputError(f"--world-size {world_size} asks for {world_size} ranks but this machine has "
                              f"{gpus} GPU{'s' if gpus != 1 else ''} (one rank per GPU)",
                              f"give --world-size {gpus} or less")


def _token_budget(cfg: TrainerConfig) -> int | None:
    for section in (cfg, cfg.algorithm):
        value = getattr(section, "max_tokens_per_micro_batch", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def run(spec: BenchSpec, progress: ProgressCallback = _no_progress) -> dict[str, Any]:
    """Prepare the model, train ``spec.steps`` steps on ``spec.world_size`` ranks, return the numbers."""
    cfg = check_spec(spec)
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="staleflow-bench-trainer-") as tmp:
        scratch = Path(tmp)
        progress("model", 0, 1)
        started = time.perf_counter()
        source = prepare_model(spec.model, scratch / "model", cfg)
        model_seconds = time.perf_counter() - started
        progress("model", 1, 1)
        results = _train_on_ranks(spec, cfg, source, scratch, progress)
    rank0 = results[0]
    measured = rank0["steps"][1:] or rank0["steps"]
    seconds = sum(measured) / len(measured)
    head_measured = rank0["head_seconds"][-len(measured):]
    tokens = rank0["tokens_per_step"]
    peak_tflops = rank0["peak_tflops"]  # --peak-tflops, else the device's from the table
    on_gpu = rank0["device_type"] == "cuda"
    tokens_per_s = tokens / seconds
    mfu = model_flops_utilization(source.parameters, tokens_per_s, peak_tflops, spec.world_size) \
        if on_gpu and peak_tflops else None
    lengths = response_lengths(spec.batch, spec.response_tokens, spec.response_dist, spec.seed)
    return {
        "model": str(spec.model), "architecture": source.architecture, "random_init": source.random_init,
        "params": source.parameters,
        "device": rank0["device"], "world_size": spec.world_size,
        "peak_tflops": peak_tflops if on_gpu else None,
        "batch": spec.batch, "group_size": spec.group_size, "prompt_tokens": spec.prompt_tokens,
        "response_tokens": spec.response_tokens, "response_dist": spec.response_dist,
        "response_lengths": {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)},
        "tokens_per_step": tokens,
        "trainer": cfg.model_dump(mode="json"),
        "state_bytes": sum(r["state"]["total"] for r in results),
        "state": {k: sum(r["state"][k] for r in results) for k in ("parameters", "gradients", "optimizer", "on_device")},
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in results),
        "activation_peak_bytes": max(r["activation_peak_bytes"] for r in results),
        "memory_kind": rank0["memory_kind"],
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "steps": rank0["steps"],
        "step_seconds": seconds,
        "head_seconds": rank0["head_seconds"],
        "head_share": sum(head_measured) / sum(measured),
        "token_budget": rank0["token_budget"],
        "warmup_steps_excluded": len(rank0["steps"]) - len(measured),
        "model_seconds": model_seconds,
        "load_seconds": rank0["load_seconds"],
        "per_rank": [{k: r[k] for k in ("rank", "peak_memory_bytes", "activation_peak_bytes", "baseline_bytes")}
                     | {"state_bytes": r["state"]["total"]} for r in results],
        "last_metrics": rank0["metrics"],
        "versions": {"staleflow": package_version("staleflow"), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }


def _train_on_ranks(spec: BenchSpec, cfg: TrainerConfig, source: ModelSource, scratch: Path,
                    progress: ProgressCallback) -> list[dict[str, Any]]:
    """Rank 0 here, ranks 1.. as spawned processes; every rank trains the same batch (each its
    share, as ``FsdpBackend.train`` splits it) and rank 0 gathers their numbers."""
    port = free_port()
    checkpoints = scratch / "checkpoints"  # the backend looks for one to resume from; none is written
    context = multiprocessing.get_context("spawn")
    followers = [context.Process(target=_follower, args=(rank, port, spec, cfg.model_dump_json(), checkpoints, source),
                                 daemon=True, name=f"bench-rank-{rank}") for rank in range(1, spec.world_size)]
    for p in followers:
        p.start()
    failed = threading.Event()
    watch = threading.Thread(target=_watch, args=(followers, failed), daemon=True)
    watch.start()
    try:
        return _rank(0, port, spec, cfg, checkpoints, source, progress)
    finally:
        failed.set()
        for p in followers:
            p.join(60)


def _watch(followers: list[Any], done: threading.Event) -> None:
    """Rank 0 would wait in a collective for a rank that died: end the run with its exit code."""
    while not done.wait(0.5):
        for p in followers:
            if p.exitcode not in (None, 0):
                os.write(2, f"error: {p.name} exited with code {p.exitcode} (its error is above)\n".encode())
                os._exit(1)


def _follower(rank: int, port: int, spec: BenchSpec, cfg_json: str, checkpoints: Path, source: ModelSource) -> None:
    from staleflow.training.fsdp import _die_with_parent

    _die_with_parent()
    _rank(rank, port, spec, TrainerConfig.model_validate_json(cfg_json), checkpoints, source, _no_progress)


def _rank(rank: int, port: int, spec: BenchSpec, cfg: TrainerConfig, checkpoints: Path, source: ModelSource,
          progress: ProgressCallback) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from staleflow.training.fsdp import FsdpBackend, init_process_group

    quiet_transformers()
    init_process_group(rank, spec.world_size, port)
    try:
        progress("load", 0, 1)
        started = time.perf_counter()
        backend = FsdpBackend(cfg, source.directory, checkpoints, rank, spec.world_size, spec.steps)
        load_seconds = time.perf_counter() - started
        progress("load", 1, 1)
        batch = synthetic_batch(spec, source.vocab_size)
        tokens = trained_tokens(batch)
        meter = StepMeter(backend.device, source.parameters, spec.world_size, spec.peak_tflops)
        backend.head_timer = head_timer = SectionTimer(backend.device)
        meter.memory.synchronize()
        baseline = meter.memory.current()
        steps, head_seconds, peaks, metrics = [], [], [], {}
        progress("step", 0, spec.steps)
        for step in range(spec.steps):
            meter.start()
            try:
                metrics = backend.train(step, batch)
            except torch.OutOfMemoryError:
                raise BenchInputError(
                    f"rank {rank} ran out of device memory in step {step + 1} "
                    f"({meter.memory.peak() / 2**30:.1f} GiB allocated at the peak)",
                    "train less per micro-batch (--set algorithm.micro_batch=..., or a smaller token budget), turn on "
                    "mixed precision / activation checkpointing, or use more ranks") from None
            measured = meter.stop(tokens)
            steps.append(measured["step_seconds"])
            head_seconds.append(head_timer.seconds())
            peaks.append(int(measured["peak_memory_bytes"]))
            progress("step", step + 1, spec.steps)
        state = state_bytes(backend)
        later_state = state["on_device"] - state["parameters_on_device"]  # what the steps allocated
        peak = max(peaks)
        mine = {
            "rank": rank, "steps": steps, "head_seconds": head_seconds, "token_budget": backend.token_budget,
            "tokens_per_step": tokens, "state": state,
            "peak_memory_bytes": peak, "baseline_bytes": baseline,
            "activation_peak_bytes": max(0, peak - baseline - later_state),
            "memory_kind": meter.memory.kind, "load_seconds": load_seconds, "metrics": metrics,
            "device_type": backend.device.type,
            "device": torch.cuda.get_device_name(backend.device) if backend.device.type == "cuda" else "cpu",
            "peak_tflops": meter.peak_tflops,
        }
        gathered: list[Any] = [None] * spec.world_size
        dist.all_gather_object(gathered, mine)
        return gathered
    finally:
        dist.destroy_process_group()

