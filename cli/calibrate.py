"""``staleflow calibrate``: profile a rollout engine and fit the cost model (paper Appendix B).

    staleflow calibrate --engine sim --k1 1e-7 --noise 0.05 --out calibration.json --plot fig.png
    staleflow calibrate --engine vllm --model /models/qwen --out calibration.json --json

Measures decode-step latency over a grid of running counts x context lengths, the KV footprint
per token (k5), the KV budget (M), prefill cost per token and weight-load time; fits k1..k4
(``staleflow.calibration``), writes the entry for (model, parallelism) into the calibration file
and refuses (exit 3) or warns on a poor fit. See docs/calibrate.md. The profiling and fitting live in
``staleflow.calibration.run``, the plot in ``staleflow.calibration.plot``; this module parses the
flags, shows progress and prints.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from staleflow.calibration import (
    PAPER_MAPE,
    CalibrationEntry,
    CalibrationError,
    DecodeReport,
    Thresholds,
    write_calibration,
)
from staleflow.calibration.engine_setup import EngineSetupError
from staleflow.calibration.plot import plot_calibration
from staleflow.calibration.profile import Probe
from staleflow.calibration.run import (
    COEFFICIENTS,
    SIM_GRID,
    VLLM_GRID,
    calibration_document,
    crossover_text,
    profile_and_fit,
    sim_probe,
    vllm_probe,
)
from staleflow.cli.common import console, err_console, fail
from staleflow.config.calibration import ProfileConfig
from staleflow.config.engines import SimParams
from staleflow.cost_model import CostModel
from staleflow.engines.base import EngineError

POOR_FIT_EXIT = 3
CALIBRATE_INSTALL = {  # the install that brings scikit-learn, by engine
    "vllm": "pip install -e '.[vllm,train]' (the README's install; it carries scikit-learn)",
    "sim": "pip install -e '.[calibrate]'",
}
def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise fail(f"{flag} takes comma-separated integers, got {text!r}", f"e.g. {flag} 1,2,4,8") from None
    if not values or min(values) < 1:
        raise fail(f"{flag} needs positive integers, got {text!r}")
    return values


def _config(base: ProfileConfig, **overrides: Any) -> ProfileConfig:
    try:
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise fail(f"invalid profiling grid: {exc}") from None


def _sim_probe(cost: dict[str, float], noise: float, seed: int, prefill: float, max_running: int) -> tuple[Probe, dict]:
    try:
        return sim_probe(cost, noise, seed, prefill, max_running)
    except ValueError as exc:
        raise fail(f"invalid sim engine settings: {exc}", "coefficients and --noise must be >= 0") from None


def _vllm_probe(model: Path | None, dtype: str, max_model_len: int | None, kv_cache_gib: int | None,
                max_num_seqs: int | None, enforce_eager: bool, cpu_threads: int | None, largest_n: int) -> Probe:
    if model is None:
        raise fail("--engine vllm needs --model DIR (a local model directory)",
                   "pass a Hugging Face model directory; `staleflow init-demo` builds a small one and prints where")
    if not model.is_dir():
        raise fail(f"model directory {str(model)!r} does not exist",
                   "pass a local directory with config.json and weights")
    if cpu_threads is not None and cpu_threads < 1:
        raise fail(f"--cpu-threads must be >= 1, got {cpu_threads}")
    try:
        probe, settings = vllm_probe(model, dtype, max_model_len, kv_cache_gib, max_num_seqs, enforce_eager,
                                     cpu_threads, largest_n)
    except EngineSetupError as exc:
        raise fail(str(exc), exc.fix) from None
    if settings.notes:
        err_console.print(f"calibrate: derived {'; '.join(settings.notes)}", highlight=False, soft_wrap=True)
    return probe


async def _profile_and_fit(
    probe: Probe, config: ProfileConfig, **fit: Any
) -> tuple[CalibrationEntry, DecodeReport]:
    columns = (TextColumn("[bold]calibrate[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    # on stderr, so --json output stays clean; only where someone watches
    started = time.monotonic()

    def plain(done: int, total: int, what: str) -> None:  # a line per step where no terminal shows the bar
        err_console.print(f"calibrate [{done}/{total}] {what} ({time.monotonic() - started:.0f} s)", highlight=False)

    live = err_console.is_terminal
    with Progress(*columns, console=err_console, transient=True, disable=not live) as progress:
        task = progress.add_task("starting the engine", total=None)
        return await profile_and_fit(
            probe, config,
            (lambda done, total, what: progress.update(task, completed=done, total=total, description=what))
            if live else plain,
            stopping=lambda: progress.update(task, description="stopping the engine"), **fit)


def _print_summary(entry: CalibrationEntry, doc: dict[str, Any]) -> None:
    table = Table(title=f"cost model of {entry.model} / {entry.parallelism} ({entry.engine})")
    table.add_column("coefficient")
    table.add_column("fitted", justify="right")
    spread = entry.quality.spread or {}
    recovery = doc.get("recovery", {})
    if entry.truth:
        table.add_column("truth", justify="right")
        table.add_column("error", justify="right")
    table.add_column("bootstrap ±", justify="right")
    for k in COEFFICIENTS:
        row = [k, f"{getattr(entry.cost, k):.4g}"]
        if entry.truth:
            row += [f"{entry.truth[k]:.4g}", f"{recovery[k]:+.2%}" if k in recovery else "-"]
        row.append(f"{spread[k]:.1%}" if k in spread else "")
        table.add_row(*row)
    console.print(table)
    q = entry.quality
    held = "n/a"
    if q.holdout_mape is not None:
        held = f"{q.holdout_mape:.2%} cross-validated ({q.folds} folds over {q.holdout_points} grid points)"
    crossover = crossover_text(entry)
    lines = [
        f"regime: {entry.regime}; crossover n* (k2/k3){crossover}",
        f"throughput error: {held} (in sample {q.mape:.2%}, worst {q.max_ape:.2%}; paper: {PAPER_MAPE:.2%})",
        f"step-latency r² {q.r2:.4f}; relative residuals mean {q.residual_mean:+.2%}, sd {q.residual_std:.2%}",
        f"k5 = {entry.cost.k5:.4g} {entry.kv_unit}/token (r² {q.kv_r2:.4f}); "
        f"KV budget M = {entry.cost.kv_budget:,.0f}",
    ]
    if entry.kv_bytes_per_token:
        lines.append(f"KV footprint: {entry.kv_bytes_per_token:,.0f} bytes/token "
                     f"(M = {entry.cost.kv_budget / entry.cost.k5 * entry.kv_bytes_per_token / 2**30:.2f} GiB)")
    if entry.prefill_seconds_per_token is not None:
        lines.append(f"prefill: {entry.prefill_seconds_per_token:.3g} s/token")
    if entry.weight_load_seconds is not None:
        lines.append(f"weight load: {entry.weight_load_seconds:.3g} s")
    lines.append(f"{q.samples} samples at {q.grid_points} grid points; profiling took {entry.wall_seconds:.1f} s")
    for line in lines:
        console.print(line)
    for warning in entry.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")


SHORT_STEP_S = 5e-3  # decode steps shorter than this are mostly the engine's per-step overhead


def short_step_reason(entry: CalibrationEntry) -> str | None:
    """Why a real-time fit of a model this small misses the limit, and what model size fits: None
    where its decode steps are long enough for that not to be the reason."""
    cost = entry.cost
    step = cost.k4 + max(cost.k2, cost.k3)
    if entry.engine == "sim" or step >= SHORT_STEP_S:
        return None
    return (f"why: a decode step of this model takes {step * 1e3:.1f} ms with one trajectory running, "
            f"{cost.k4 * 1e3:.1f} ms of it the engine's fixed per-step overhead (k4); steps that short vary from "
            "interval to interval by more than the limit while other processes share the CPU. A model whose step "
            f"takes {SHORT_STEP_S * 1e3:.0f} ms or more (on this kind of CPU about 20M parameters, e.g. 6 layers of "
            "width 512: 6.2 % measured in docs/calibrate.md) fits within it, as does this one on a quiet machine")


def _announce_poor_fit(entry: CalibrationEntry, refused: bool) -> None:
    head = "[bold red]POOR FIT, REFUSED:[/]" if refused else "[bold red]WARNING: POOR FIT[/]"
    for problem in entry.problems:
        err_console.print(f"{head} {escape(problem)}")
    reason = short_step_reason(entry)
    if reason:
        err_console.print(escape(reason))
    if refused:
        err_console.print("[bold]fix:[/] profile a wider grid, longer intervals (--steps-per-sample, "
                          "--samples-per-point) on a quiet machine, or relax --max-mape / --min-r2; "
                          "--on-poor-fit warn writes it anyway (marked ok=false)")


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        engine: Annotated[str, typer.Option(help="engine to profile: sim or vllm")] = "sim",
        model: Annotated[Path | None, typer.Option(help="vllm: local model directory")] = None,
        model_name: Annotated[str | None, typer.Option(
            help="calibration key (default: sim, or the model dir's name)")] = None,
        parallelism: Annotated[str, typer.Option(help="calibration key: the instance's parallelism, e.g. tp1")] = "tp1",
        out: Annotated[Path, typer.Option(help="calibration file to add the entry to")] = Path("calibration.json"),
        no_write: Annotated[bool, typer.Option("--no-write", help="do not write the calibration file")] = False,
        plot: Annotated[Path | None, typer.Option(help="write measured vs estimated throughput here (PNG)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the fit as one JSON document")] = False,
        # sim engine: the ground truth the fit should recover
        k1: Annotated[float, typer.Option(help="sim: true k1 (s per KV unit per step)")] = CostModel.k1,
        k2: Annotated[float, typer.Option(help="sim: true k2 (s)")] = CostModel.k2,
        k3: Annotated[float, typer.Option(help="sim: true k3 (s per running trajectory)")] = CostModel.k3,
        k4: Annotated[float, typer.Option(help="sim: true k4 (s)")] = CostModel.k4,
        k5: Annotated[float, typer.Option(help="sim: true k5 (KV units per token)")] = CostModel.k5,
        kv_budget: Annotated[float, typer.Option(help="sim: true KV budget M (KV units)")] = CostModel.kv_budget,
        noise: Annotated[float, typer.Option(help="sim: sigma of the multiplicative step-latency noise")] = 0.0,
        sim_seed: Annotated[int, typer.Option(help="sim: noise seed")] = 0,
        prefill_seconds_per_token: Annotated[float, typer.Option(
            help="sim: true prefill cost (s/token)")] = SimParams.prefill_seconds_per_token,
        max_running: Annotated[int, typer.Option(help="sim: max running trajectories")] = SimParams.max_running,
        # vllm engine
        dtype: Annotated[str, typer.Option(help="vllm: dtype")] = "bfloat16",
        max_model_len: Annotated[int | None, typer.Option(
            help="vllm: max_model_len (default: the model's positions, at most 4096)")] = None,
        kv_cache_gib: Annotated[int | None, typer.Option(
            help="vllm (CPU): KV cache GiB (default: what the grid fills, at most half the free memory)")] = None,
        max_num_seqs: Annotated[int | None, typer.Option(help="vllm: max_num_seqs")] = None,
        enforce_eager: Annotated[bool, typer.Option(help="vllm: eager mode (no torch.compile)")] = True,
        cpu_threads: Annotated[int | None, typer.Option(
            help="vllm CPU build: OpenMP threads of the engine, unpinned (default: vLLM's, one per core, pinned)")] = None,
        # the grid (defaults depend on the engine)
        n_values: Annotated[str | None, typer.Option(help="running counts, comma-separated")] = None,
        contexts: Annotated[str | None, typer.Option(help="prompt lengths, comma-separated")] = None,
        samples_per_point: Annotated[int | None, typer.Option(help="intervals measured per grid point")] = None,
        steps_per_sample: Annotated[int | None, typer.Option(help="decode steps per interval")] = None,
        max_sample_seconds: Annotated[float | None, typer.Option(help="real time: longest interval")] = None,
        prefill_contexts: Annotated[str | None, typer.Option(help="prompt lengths for the prefill probe")] = None,
        weight_loads: Annotated[int | None, typer.Option(help="weight loads to time")] = None,
        passes: Annotated[int | None, typer.Option(help="grid passes; each point keeps its fastest")] = None,
        max_foreign_load: Annotated[float | None, typer.Option(
            help="real time: drop intervals in which other processes used more cores than this")] = None,
        subtract_wait: Annotated[bool | None, typer.Option(
            "--subtract-wait/--no-subtract-wait",
            help="real time: leave out the time the engine's thread waited for a CPU held by others")] = None,
        # the fit
        folds: Annotated[int, typer.Option(help="cross-validation folds over grid points (0: none)")] = 4,
        bootstrap: Annotated[int, typer.Option(help="bootstrap rounds for coefficient spread (0: off)")] = 20,
        seed: Annotated[int, typer.Option(help="seed of the held-out split and prompts")] = 0,
        max_mape: Annotated[float, typer.Option(help="poor fit above this throughput error")] = Thresholds().max_mape,
        min_r2: Annotated[float, typer.Option(help="poor fit below this step-latency r²")] = Thresholds().min_r2,
        on_poor_fit: Annotated[str, typer.Option(help="refuse (exit 3, nothing written) or warn")] = "refuse",
    ) -> None:
        """Profile an engine and fit the cost model k1..k5, M (paper Appendix B)."""
        if importlib.util.find_spec("sklearn") is None:
            raise fail("calibration fits with scikit-learn, which is not installed",
                       CALIBRATE_INSTALL[engine] if engine in CALIBRATE_INSTALL else CALIBRATE_INSTALL["vllm"])
        if engine not in ("sim", "vllm"):
            raise fail(f"--engine must be sim or vllm, got {engine!r}")
        if on_poor_fit not in ("refuse", "warn"):
            raise fail(f"--on-poor-fit must be refuse or warn, got {on_poor_fit!r}")
        if folds < 0 or folds == 1 or bootstrap < 0:
            raise fail("--folds must be 0 (none) or >= 2, and --bootstrap >= 0")
        try:
            thresholds = Thresholds(max_mape=max_mape, min_r2=min_r2)
        except ValueError as exc:
            raise fail(f"invalid thresholds: {exc}") from None
        truth = None
        if engine == "sim":
            probe, truth = _sim_probe(dict(k1=k1, k2=k2, k3=k3, k4=k4, k5=k5, kv_budget=kv_budget), noise, sim_seed,
                                      prefill_seconds_per_token, max_running)
            base, name = SIM_GRID, model_name or "sim"
        else:
            base, name = VLLM_GRID, model_name or os.path.basename(os.path.normpath(str(model)))
        config = _config(
            base, n_values=_ints(n_values, "--n-values"), contexts=_ints(contexts, "--contexts"),
            samples_per_point=samples_per_point, steps_per_sample=steps_per_sample,
            max_sample_seconds=max_sample_seconds, prefill_contexts=_ints(prefill_contexts, "--prefill-contexts"),
            weight_loads=weight_loads, passes=passes, max_foreign_load=max_foreign_load, seed=seed,
            subtract_wait=subtract_wait,
        )
        if engine == "vllm":
            probe = _vllm_probe(model, dtype, max_model_len, kv_cache_gib, max_num_seqs, enforce_eager, cpu_threads,
                                max(config.n_values))
        fit = dict(model=name, parallelism=parallelism, engine=engine, thresholds=thresholds, folds=folds,
                   truth=truth, bootstrap=bootstrap)
        try:
            entry, report = asyncio.run(_profile_and_fit(probe, config, **fit))
        except EngineSetupError as exc:
            raise fail(str(exc), exc.fix) from None
        except (CalibrationError, EngineError) as exc:
            raise fail(f"calibration failed: {getattr(exc, 'message', exc)}") from None
        refused = not entry.ok and on_poor_fit == "refuse"
        written = not no_write and not refused
        if written:
            try:
                write_calibration(out, entry)
            except CalibrationError as exc:
                raise fail(str(exc), "pass another --out or remove the file") from None
        if plot is not None:
            plot_calibration(entry, report, plot)
        doc = calibration_document(entry, report, out, written)
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        else:
            _print_summary(entry, doc)
            if written:
                console.print(f"wrote {entry.model} / {entry.parallelism} to {out}")
            if plot is not None:
                console.print(f"plot: {plot}")
        if not entry.ok:
            _announce_poor_fit(entry, refused)
            if refused:
                raise typer.Exit(POOR_FIT_EXIT)
