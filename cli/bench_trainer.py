"""``staleflow bench trainer``: the FSDP2 trainer on a synthetic GRPO batch (``staleflow.training.bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from staleflow.cli.common import console, emit_results, err_console, fail, validation_failure
from staleflow.config import TrainerConfig

PHASES = {"model": "building the model", "load": "loading it on every rank", "step": "training"}


def trainer_settings(assignments: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (``algorithm.micro_batch=4``, ``trainer.mixed_precision=true``) as the
    nested ``trainer`` section of a job file; values are YAML (``true``, ``4``, ``1e-5``, ``[a, b]``)."""
    settings: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        path = [part for part in key.strip().removeprefix("trainer.").split(".") if part]
        if not sep or not path:
            raise fail(f"--set {assignment!r} is not key=value",
                       "write a trainer setting as --set name=value, e.g. --set algorithm.micro_batch=4")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        section = settings
        for part in path[:-1]:
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise fail(f"--set {assignment!r}: {part} is set to a value and used as a section",
                           "set either the section's fields or the value, not both")
        section[path[-1]] = value
    return settings


def _progress_callback(progress: Progress) -> Any:
    tasks: dict[str, TaskID] = {}

    def report(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(PHASES.get(phase, phase), total=total)
        progress.update(tasks[phase], completed=done, total=total)

    return report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _show(results: dict) -> None:
    table = Table(title=f"trainer benchmark: {results['architecture']} ({results['params']:,} parameters), "
                        f"{results['device']} x {results['world_size']}")
    table.add_column("measurement")
    table.add_column("result", justify="right")
    lengths = results["response_lengths"]
    table.add_row("batch", f"{results['batch']} x ({results['prompt_tokens']} + {results['response_dist']} responses "
                           f"{lengths['min']}..{lengths['max']}, mean {lengths['mean']:.0f}) = "
                           f"{results['tokens_per_step']:,} tokens")
    table.add_row("step seconds", ", ".join(f"{s:.2f}" for s in results["steps"]))
    table.add_row("log-prob head", f"{100 * results['head_share']:.1f} % of the step "
                                   f"({', '.join(f'{s:.2f}' for s in results['head_seconds'])} s)")
    table.add_row("token budget per micro-batch", "none (micro_batch rows)" if results["token_budget"] is None
                  else f"{results['token_budget']:,} tokens")
    table.add_row("tokens/s", f"{results['tokens_per_s']:,.0f}")
    table.add_row("MFU", "-" if results["mfu"] is None else f"{100 * results['mfu']:.1f} % of "
                                                          f"{results['peak_tflops']:g} TFLOP/s per GPU")
    table.add_row("state (params + grads + optimizer)", _gib(results["state_bytes"]))
    table.add_row(f"peak memory ({results['memory_kind']}, largest rank)", _gib(results["peak_memory_bytes"]))
    table.add_row("activation peak", _gib(results["activation_peak_bytes"]))
    console.print(table)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("trainer")
    def trainer_cmd(
        model: Annotated[Path, typer.Option(help="a Hugging Face model directory, or a config.json (or a directory "
                                                 "with only one): random weights, nothing downloaded")],
        batch: Annotated[int, typer.Option(help="trajectories per step")] = 8,
        prompt_tokens: Annotated[int, typer.Option(help="tokens of each prompt")] = 32,
        response_tokens: Annotated[int, typer.Option(help="tokens of each response (longtail: the longest)")] = 96,
        response_dist: Annotated[str, typer.Option(help="uniform: every response response-tokens long; longtail: "
                                                        "one in 16 that long, the rest 1/64 to 1/8 of it")] = "uniform",
        steps: Annotated[int, typer.Option(help="training steps (the first is left out of tokens/s and MFU "
                                                "when there are more)")] = 3,
        world_size: Annotated[int, typer.Option(help="FSDP2 ranks, one process each (one per GPU on a GPU machine)")] = 1,
        group_size: Annotated[int, typer.Option(help="trajectories per group (sharing a prompt)")] = 8,
        peak_tflops: Annotated[float | None, typer.Option(help="the GPU's dense bf16 peak for MFU; default: from "
                                                               "the device's name (H100, H200, A100)")] = None,
        settings: Annotated[list[str] | None, typer.Option(
            "--set", help="a trainer setting, as in a job file's trainer section: --set mixed_precision=true "
                          "--set algorithm.micro_batch=4 (repeatable)")] = None,
        seed: Annotated[int, typer.Option(help="seed of the synthetic batch")] = 0,
        as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
        output: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
    ) -> None:
        """Train STEPS steps of a synthetic GRPO batch with the FSDP2 trainer: step seconds, tokens/s, MFU, memory."""
        from staleflow.training.bench import BenchInputError, BenchSpec, run

        trainer = trainer_settings(settings or [])
        try:
            TrainerConfig.model_validate(trainer)
        except ValidationError as exc:
            flags = {f"{'.'.join(str(p) for p in e['loc'])}": f"--set {'.'.join(str(p) for p in e['loc'])}=..."
                     for e in exc.errors()}
            raise validation_failure(exc, flags, TrainerConfig, complete_flags=True) from None
        spec = BenchSpec(model=model, batch=batch, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                         response_dist=response_dist, steps=steps, world_size=world_size, group_size=group_size,
                         peak_tflops=peak_tflops, seed=seed, trainer=trainer)
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=err_console, transient=True,
                          disable=not err_console.is_terminal) as progress:
                results = run(spec, _progress_callback(progress))
        except BenchInputError as exc:
            raise fail(exc.message, exc.fix) from None
        emit_results(results, output, as_json, _show)
