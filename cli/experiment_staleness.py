"""``staleflow experiment staleness``: staleness vs convergence, measured (the paper's Figure 14).

Runs the real job (``staleflow up``, one run at a time) at each staleness bound and once without
an effective bound, then plots reward against step and against wall-clock time in one figure and
writes the numbers next to it. Runs that already finished in the output directory are reused, so
an interrupted experiment continues where it stopped (``--rerun`` runs them again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from staleflow.cli.common import console, fail

experiment_app = typer.Typer(help="Experiments that run several jobs and compare them.", no_args_is_help=True)


def _parse_etas(text: str) -> list[int]:
    try:
        etas = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--etas {text!r} is not a comma-separated list of integers", "e.g. --etas 0,1,2") from None
    if any(e < 0 for e in etas):
        raise fail(f"--etas {text!r}: staleness bounds are >= 0", "e.g. --etas 0,1,2")
    return etas


def _finished(state_dir: Path) -> bool:
    return (state_dir / "report" / "summary.json").exists()


def register(app: typer.Typer) -> None:
    app.add_typer(experiment_app, name="experiment")

    @experiment_app.command("staleness")
    def staleness(
        etas: Annotated[str, typer.Option(help="staleness bounds to run, comma-separated")] = "0,1,2",
        unbounded: Annotated[bool, typer.Option(
            "--unbounded/--no-unbounded", help="also run without an effective bound (eta = steps)")] = True,
        steps: Annotated[int, typer.Option(help="training steps per run")] = 20,
        seed: Annotated[int, typer.Option(help="the jobs' seed (prompts, sampling)")] = 0,
        config: Annotated[Path | None, typer.Option(
            "--config", help="job file every run starts from (its eta and steps are overridden)")] = None,
        out: Annotated[Path, typer.Option("--out", help="directory of the runs' state and the results")] = Path(
            "runs/staleness"),
        figure: Annotated[Path | None, typer.Option(help="PNG to write (default: OUT/staleness.png)")] = None,
        rerun: Annotated[bool, typer.Option("--rerun", help="run again the runs that already finished in OUT")] = False,
        plot_only: Annotated[bool, typer.Option("--plot-only", help="plot the finished runs in OUT, run nothing")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print the results as JSON")] = False,
    ) -> None:
        """Run the real job at eta = 0, 1, 2 and without a bound; plot reward vs step and vs time."""
        from staleflow.report import plot_staleness_convergence
        from staleflow.staleness_experiment import WINDOW, run_numbers, staleness_plan
        from staleflow.training.role import StepLog

        if config is not None and not config.exists():
            raise fail(f"config file {config} does not exist")
        try:
            plan = staleness_plan(_parse_etas(etas), steps, out, unbounded)
        except ValueError as exc:
            raise fail(str(exc)) from None
        out.mkdir(parents=True, exist_ok=True)
        for run in plan:
            if plot_only or (_finished(run.state_dir) and not rerun):
                continue
            command = [sys.executable, "-m", "staleflow.cli", "up", *run.up_arguments(steps, seed),
                       *(["--config", str(config)] if config else [])]
            if not as_json:
                console.print(f"[bold]{run.label}[/]: {' '.join(command[1:])}")
            log = run.state_dir.parent / f"{run.state_dir.name}.out"
            with log.open("w") as sink:
                done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                raise fail(f"{run.label}: `staleflow up` exited with {done.returncode}",
                           f"see {log} and {run.state_dir / 'logs'}", code=1)
        results = []
        for run in plan:
            if not _finished(run.state_dir):
                if plot_only:
                    continue
                raise fail(f"{run.label}: no finished run in {run.state_dir}")
            summary = json.loads((run.state_dir / "report" / "summary.json").read_text())
            records = [{"mean_reward": s.mean_reward, "finished_at": s.finished_at, "staleness": s.staleness,
                        "response_tokens": s.response_tokens}
                       for s in StepLog(run.state_dir / "trainer" / "steps.jsonl").read()]
            results.append(run_numbers(run, records, summary))
        if not results:
            raise fail(f"no finished runs in {out}", "run the experiment without --plot-only first")
        target = figure or out / "staleness.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        plot_staleness_convergence(target, results)
        (out / "staleness.json").write_text(json.dumps({"figure": str(target), "runs": results}, indent=2))
        if as_json:
            print(json.dumps({"figure": str(target), "results": str(out / "staleness.json"), "runs": results}))
            return
        table = Table(title=f"staleness vs convergence (figure: {target}; numbers: {out / 'staleness.json'})")
        for col in ("run", f"first {WINDOW}", f"last {WINDOW}", "change", "wall s", "tokens/s", "max staleness"):
            table.add_column(col, justify="left" if col == "run" else "right")
        for r in results:
            table.add_row(r["label"], f"{r[f'first_{WINDOW}']:.3f}", f"{r[f'last_{WINDOW}']:.3f}", f"{r['rise']:+.3f}",
                          f"{r['wall_seconds']:.0f}", f"{r['tokens_per_second']:.1f}", str(r["max_staleness"]))
        console.print(table)
