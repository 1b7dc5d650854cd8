"""``staleflow soak``: run a long simulated job; compare its costs near the start and near the end."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from staleflow.cli.common import console, fail
from staleflow.cli.up import job_config

if TYPE_CHECKING:
    from staleflow.launch.soak import SoakResult

SOAK_DEFAULTS = {"engine": "sim", "workload": "ci-tiny", "instances": 2, "speed": 200.0, "max_tokens": 16,
                 "batch_size": 1, "group_size": 2, "eta": 2, "cycle_period": 0.1,
                 "manager": {"synchronous": "NORMAL"}, "trainer": {"push_bytes": 64 << 10}}
"""A small, fast job: many steps, each cheap, so that history piles up quickly. A step's CPU time is
mostly HTTP requests, some per step and some per cycle: one group a batch and a 100 ms cycle keep
both few, eta 2 keeps enough groups in flight to hide a cycle's latency, and the ledger commits
without an fsync each (a crash of the process still loses nothing; a soak does not test power loss)."""

GROWTH_LIMIT = 1.5
"""End over start allowed for the per-cycle cost and the restart time."""

MEMORY_GROWTH_LIMIT = 0.10
"""Growth allowed of any process's resident memory, from the first to the last quarter of the run."""

SHAPES = ("small", "default")
"""``small``: ``SOAK_DEFAULTS`` (one group a batch: history piles up fast). ``default``: the job
``staleflow up --engine sim`` runs (128 trajectories a step on four instances), where what an
instance or the trainer keeps per trajectory shows."""


def register(app: typer.Typer) -> None:
    @app.command()
    def soak(
        steps: Annotated[int, typer.Option(help="training steps")] = 2000,
        config: Annotated[Path | None, typer.Option("--config", help="job file, as for `staleflow up` "
                                                                     "(default: a small sim job)")] = None,
        state_dir: Annotated[Path, typer.Option("--state-dir", help="where the run keeps its state")] = Path(
            ".staleflow-soak"),
        instances: Annotated[int | None, typer.Option(help="rollout instances")] = None,
        speed: Annotated[float | None, typer.Option(help="sim clock speed-up")] = None,
        batch_size: Annotated[int | None, typer.Option(help="prompt groups per batch")] = None,
        shape: Annotated[str, typer.Option(help="small: one group a batch (history piles up fast); default: the "
                                                "job `staleflow up --engine sim` runs, 128 trajectories a step")] = "small",
        warmup: Annotated[int, typer.Option(help="measure the start after this many steps")] = 20,
        end_margin: Annotated[int, typer.Option(help="measure the end this many steps before the last")] = 20,
        sample_every: Annotated[int, typer.Option(help="sample the store sizes every this many steps")] = 50,
        window: Annotated[float, typer.Option(help="seconds over which the per-cycle cost is averaged")] = 10.0,
        deadline: Annotated[float, typer.Option(help="give up after this many seconds")] = 86_400.0,
        stop_after: Annotated[float | None, typer.Option(help="time box: measure the end after this many seconds "
                                                              "and stop there, even if steps remain")] = None,
        restarts: Annotated[int, typer.Option(help="trajectory-server restarts timed at each end (median)")] = 3,
        output: Annotated[Path | None, typer.Option("--output", help="write the report (JSON) here")] = None,
        plot: Annotated[Path | None, typer.Option("--plot", help="draw the store sizes over the run (PNG) here")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    ) -> None:
        """Run a job for many steps and measure, near its start and near its end, the coordinator's
        cost per cycle, the time of its polls of the trajectory server, the live and archived store
        and the trajectory server's restart time (a SIGKILL each time). Fails (exit 1) if the job does
        not finish (or reach its time box), a cost at the end exceeds 1.5x the start, or the resident
        memory of any process (component or trainer) grows by more than 10 % from the first to the
        last quarter of the run."""
        from staleflow.launch.soak import Soak, write_report
        from staleflow.launch.soak import plot as draw

        if shape not in SHAPES:
            raise fail(f"--shape {shape!r} is not a job shape", "use --shape small or --shape default")
        flags = {"steps": steps, "instances": instances, "speed": speed, "batch_size": batch_size}
        if config is None and shape == "small":
            flags = {**SOAK_DEFAULTS, **{k: v for k, v in flags.items() if v is not None}}
        elif config is None:
            flags = {"engine": "sim", **flags}
        cfg = job_config(config, **flags, processes=True, state_dir=state_dir)
        logging.basicConfig(level=logging.ERROR)
        say = (lambda m: None) if as_json else (lambda m: console.print(f"  {m}"))
        try:
            result = Soak(cfg, warmup_steps=warmup, end_margin_steps=end_margin, sample_every_steps=sample_every,
                          window_s=window, deadline_s=deadline, stop_after_s=stop_after, restarts=restarts).run(say)
        except ValueError as exc:
            raise fail(str(exc), "see `staleflow soak --help`") from None
        report = result.to_json()
        report["command"] = f"staleflow soak --shape {shape} --steps {cfg.steps}"
        if output:
            write_report(output, report)
        if plot:
            if draw(report, plot) is None:
                console.print("no plot: matplotlib is not installed")
        if as_json:
            typer.echo(json.dumps(report, default=str))
        else:
            table = Table(title=f"soak: {result.steps_done} of {result.steps_planned} steps in {result.wall_s:.0f}s")
            for col in ("", "step", "cycle ms", "cycles/s", "coordinator cpu ms/cycle", "job cpu ms/step", "poll ms",
                        "live", "archived", "ledger events", "ts restart s"):
                table.add_column(col, justify="right")
            for name, c in (("start", result.start), ("end", result.end)):
                if c is not None:
                    cpu_per_step = sum(c.cpu_ms_per_step.values())
                    table.add_row(name, str(c.step), f"{c.cycle_ms:.2f}", f"{c.cycles_per_s:.1f}",
                                  "-" if c.coordinator_cpu_ms is None else f"{c.coordinator_cpu_ms:.2f}",
                                  f"{cpu_per_step:.1f}" if cpu_per_step else "-", f"{c.poll_ms:.2f}",
                                  str(c.live_trajectories), str(c.archived_trajectories), str(c.ledger_events),
                                  "-" if c.ts_restart_s is None else f"{c.ts_restart_s:.2f}")
            console.print(table)
            console.print("end / start: " + ", ".join(
                f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in result.ratios().items()))
            console.print(f"live trajectories at most {report['live_trajectories_max']} over the run")
            if result.samples:
                last = result.samples[-1]
                console.print(f"database files at step {last.step}: trajectories {last.trajectories_db_bytes / 1e6:.1f} MB, "
                              f"ledger {last.ledger_db_bytes / 1e6:.1f} MB")
            if result.stopped_early and result.end is not None:
                console.print(f"stopped by the time box (--stop-after) at step {result.end.step}")
            _print_memory(result)
        ratios = result.ratios()
        # the cost of a cycle is judged by CPU time where it was measured (Linux): wall time on a
        # shared machine grows with the machine's load as much as with the job's own work
        costs = ("coordinator_cpu_ms", "job_cpu_ms_per_step") if ratios.get("coordinator_cpu_ms") else ("cycle_ms",)
        grown = [k for k in (*costs, "ts_restart_s") if (ratios.get(k) or 0) > GROWTH_LIMIT]
        leaking = [g for g in result.memory_growth().values() if g.growth > MEMORY_GROWTH_LIMIT]
        if result.failure or grown or leaking or result.start is None or result.end is None:
            if not as_json:
                console.print(f"[red]soak failed[/]: {result.failure or ''} "
                              f"{'grew: ' + ', '.join(grown) if grown else ''}".strip())
                for g in leaking:
                    console.print(f"[red]memory grew[/]: {g.component} {g.growth:+.0%} from the first to the last "
                                  f"quarter ({g.first_bytes / 2**20:.0f} -> {g.last_bytes / 2**20:.0f} MiB), more "
                                  f"than {MEMORY_GROWTH_LIMIT:.0%}: it keeps something per trajectory or per step; "
                                  f"see docs/faults.md (memory soak) for how to find what")
            raise typer.Exit(1)


def _print_memory(result: SoakResult) -> None:
    growth = result.memory_growth()
    if not growth:
        console.print("memory: too few samples between the two checkpoints to compare quarters")
        return
    table = Table(title=f"resident memory, first vs last quarter ({len(result.memory)} samples)")
    for col in ("process", "first MiB", "last MiB", "growth"):
        table.add_column(col, justify="right" if col != "process" else "left")
    for name, g in growth.items():
        table.add_row(name, f"{g.first_bytes / 2**20:.0f}", f"{g.last_bytes / 2**20:.0f}", f"{g.growth:+.1%}")
    console.print(table)
