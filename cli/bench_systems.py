"""``staleflow bench systems``: whole RL jobs of every system on one simulated cluster, side by side.

Wire it with ``bench_systems.register(bench_app)`` next to ``bench.register`` in ``cli/main.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable

from staleflow.cli.common import console, fail
from staleflow.simulation import (
    ExperimentSpec,
    RunResult,
    SimulatedJob,
    SimulationStalled,
    load_workload,
    parse_sweep,
    resolve,
    run_experiment,
    scenario,
)
from staleflow.simulation.experiment import ALL_VANILLA, plan_jobs
from staleflow.simulation.tables import Table, markdown, tables
from staleflow.simulation.transfer import WeightSource, WeightTransfer
from staleflow.transports.egress import GBIT

PRESETS = {"ci": "ci", "paper-20k": "paper-20k", "paper-40k": "paper-40k", "paper-dense-32b": "paper-dense-32b"}


def _rich(table: Table) -> RichTable:
    out = RichTable(title=table.title, title_justify="left", header_style="bold")
    for k, name in enumerate(table.header):
        out.add_column(name, justify="left" if k < 2 else "right", overflow="fold")
    for row in table.rows:
        out.add_row(*row)
    return out


def _etas(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise fail(f"--eta takes integers like 1,2,3,4, got {text!r}") from None
    if not values or min(values) < 0:
        raise fail("--eta needs at least one staleness bound >= 0")
    return values


def build_spec(preset: str, steps: int | None, eta: str, sweep: str | None, systems: str, workload: Path | None,
               instances: int | None, tune: str, seed: int, detail_eta: int | None,
               straggler_sigma: float = 0.0, weight_source: str = "ps", ps_egress_gbps: float | None = None) -> ExperimentSpec:
    if preset not in PRESETS:
        raise fail(f"unknown preset {preset!r}", f"choose one of {', '.join(PRESETS)}")
    if straggler_sigma < 0:
        raise fail(f"--straggler-sigma must be >= 0, got {straggler_sigma}")
    base = replace(scenario(PRESETS[preset], seed), straggler_sigma=straggler_sigma)
    base = replace(base, transfer=_transfer(base.transfer, weight_source, ps_egress_gbps))
    steps = base.steps if steps is None else steps
    if workload is not None:
        try:
            base = replace(base, workload=load_workload(workload.read_text(), base.workload, workload.stem).with_seed(seed))
        except (OSError, ValueError) as exc:
            raise fail(f"cannot use --workload {workload}: {exc}",
                       "give a JSON list of groups of lengths, JSONL (one group per line) or a distribution object") from None
    etas = _etas(eta)
    sweep_key, sweep_values = None, ()
    if sweep:
        try:
            sweep_key, sweep_values = parse_sweep(sweep)
        except ValueError as exc:
            raise fail(str(exc)) from None
        if sweep_key == "eta":
            etas, sweep_key, sweep_values = tuple(int(v) for v in sweep_values), None, ()
    try:
        chosen = tuple(resolve(systems, base.redundancy))
        detail = detail_eta if detail_eta is not None else (3 if 3 in etas else max(etas))
        spec = ExperimentSpec(base, chosen, etas, steps, sweep_key, sweep_values, tune, detail, instances)  # tune checked
        spec.points()  # validates the sweep values against the GPU budget
        return spec
    except ValueError as exc:
        raise fail(str(exc)) from None


def _transfer(transfer: WeightTransfer, source: str, ps_egress_gbps: float | None) -> WeightTransfer:
    if source not in {s.value for s in WeightSource}:
        raise fail(f"--weight-source {source!r}", f"choose one of {', '.join(s.value for s in WeightSource)}")
    if ps_egress_gbps is not None and not ps_egress_gbps > 0:
        raise fail(f"--ps-egress-gbps must be > 0, got {ps_egress_gbps:g}", "leave it out for an unlimited egress")
    egress = transfer.ps_egress_bytes_per_s if ps_egress_gbps is None else ps_egress_gbps * GBIT
    return replace(transfer, source=WeightSource(source), ps_egress_bytes_per_s=egress)


def run_with_progress(spec: ExperimentSpec, jobs: int):
    _, first, later = plan_jobs(spec)
    total = (len({j.key() for j in first}) + len(later) + sum(s.name == ALL_VANILLA for _, s in later)
             + sum(j.system.name == ALL_VANILLA for j in first))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"simulating {spec.scenario.name}", total=total)

        def on_run(job: SimulatedJob, run: RunResult) -> None:
            total = max(progress.tasks[0].completed + 1, progress.tasks[0].total or 0)  # matched runs are unplanned
            progress.update(task, advance=1, total=total,
                            description=f"{job.system.name} {job.point.label} x{job.instances}: "
                                        f"{run.throughput:,.0f} tok/s")

        if jobs <= 1:
            return run_experiment(spec, None, on_run)
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            return run_experiment(spec, pool, on_run)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("systems")
    def systems_cmd(
        preset: Annotated[str, typer.Option(
            help="cluster scenario: ci, paper-20k, paper-40k or paper-dense-32b")] = "paper-20k",
        steps: Annotated[int | None, typer.Option(
            min=1, help="training steps per run (default: the preset's, 20 for the paper presets)")] = None,
        eta: Annotated[str, typer.Option(help="staleness bounds, comma-separated")] = "1,2,3,4",
        sweep: Annotated[str | None, typer.Option(
            help="KEY=V1,V2,...: eta, response, batch, group, gpus, instances, mu, prefill, kv, k5, train, cycle, "
                 "straggler_sigma, nccl, ps_egress (Gbit/s)")] = None,
        systems: Annotated[str, typer.Option(
            help="all, headline, ablation, or names: verl, one-step, in-flight, in-flight-fifo, staleflow (sf-rsm), "
                 "sf-[r|x][s|x][m|x], sf-rsm+batch, sf-rsm+group, sf-rsm+ckpt, oracle; a name ending in +ros: that "
                 "system with its Pulls served by peers")] = "all",
        straggler_sigma: Annotated[float, typer.Option(
            help="persistent per-instance speed spread: log-normal sigma of each instance's fixed speed factor")] = 0.0,
        weight_source: Annotated[str, typer.Option(
            help="where Pulls come from: ps (every instance from the parameter server) or ros (peers serve what they "
                 "hold, pipelined); a system named <name>+ros uses ros whatever this says")] = WeightSource.PS.value,
        ps_egress_gbps: Annotated[float | None, typer.Option(
            help="the parameter server's egress in Gbit/s, shared by the Pulls it serves (default: unlimited, the "
                 "paper's PS workers on every rollout node)")] = None,
        workload: Annotated[Path | None, typer.Option(
            help="replay response lengths (JSON [[...],...] or JSONL) or a distribution object (JSON)")] = None,
        instances: Annotated[int | None, typer.Option(help="fix the rollout instance count (no split tuning)")] = None,
        tune: Annotated[str, typer.Option(
            help="rollout/training split tuning: once (every split at one eta per sweep value, reused at the "
                 "others), each (every split at every point), none (the middle split)")] = "once",
        no_tune: Annotated[bool, typer.Option("--no-tune", help="same as --tune none")] = False,
        seed: Annotated[int, typer.Option(help="workload seed")] = 0,
        detail_eta: Annotated[int | None, typer.Option(help="eta of the detail table and Figures 17-18")] = None,
        jobs: Annotated[int, typer.Option(min=1, help="simulations run in parallel (processes)")] = min(
            2, os.cpu_count() or 1),
        json_path: Annotated[Path | None, typer.Option("--json", help="write the full results as JSON here")] = None,
        out: Annotated[Path | None, typer.Option(help="directory for PNG figures and results.md")] = None,
        show_markdown: Annotated[bool, typer.Option("--markdown", help="also print the tables as Markdown")] = False,
    ) -> None:
        """Simulated whole RL jobs: synchronous, one-step, in-flight-limited and StaleFlow (R/S/M, redundancy)."""
        spec = build_spec(preset, steps, eta, sweep, systems, workload, instances, "none" if no_tune else tune, seed,
                          detail_eta, straggler_sigma, weight_source, ps_egress_gbps)
        try:
            result = run_with_progress(spec, jobs)
        except SimulationStalled as exc:
            raise fail(f"a simulated job stalled: {exc}", "check the workload and the preset's cluster sizes") from None
        except ValueError as exc:
            raise fail(f"cannot simulate this configuration: {exc}") from None
        for table in tables(result):
            console.print(_rich(table))
        summary = result.summary()
        status = "[green]0 violations[/]" if summary["violations"] == 0 else f"[red]{summary['violations']} violations[/]"
        console.print(f"{summary['runs']} runs, every trained trajectory checked against its bound: {status}; "
                      f"wall time {result.wall_s:.0f} s")
        text = markdown(result, _command_line())
        if show_markdown:
            console.print(text, markup=False, highlight=False, soft_wrap=True)
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(result.to_dict(), indent=1))
        if out:
            _write_figures(result, out, text)
        if summary["violations"]:
            raise typer.Exit(1)


def _command_line() -> str | None:
    """The command as typed, for the Markdown report (None when not run from a shell)."""
    argv = sys.argv
    if "systems" not in argv[:3]:
        return None
    return "staleflow bench systems " + " ".join(shlex.quote(a) for a in argv[argv.index("systems") + 1:])


def _write_figures(result, out: Path, text: str) -> None:
    from staleflow.simulation.plots import FIGURES

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    written = []
    for name, make in FIGURES.items():
        fig = make(result)
        if fig is not None:
            fig.savefig(out / f"{name}.png", dpi=120)
            written.append(f"{name}.png")
    console.print(f"wrote {out / 'results.md'} and {', '.join(written) or 'no figures'} in {out}")
