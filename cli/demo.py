"""``staleflow init-demo``: build the demo policy (tokenizer, tiny Qwen2, supervised warm-up)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from staleflow.cli.common import console, fail


def build_with_progress(digits: int, ops: str, force: bool = False, quiet: bool = False) -> tuple[Path, dict]:
    """The demo model for the task (built with a progress bar if missing)."""
    try:
        from staleflow.training.demo import MARKER, DemoSpec, demo_dir, ensure_demo_model
    except ImportError as exc:
        raise fail(f"the demo model needs torch and transformers ({exc})",
                   "pip install -e '.[train]' (or '.[vllm,train]' for `staleflow up`)") from None
    spec = DemoSpec(digits=digits, ops=ops)
    if force:
        (demo_dir(spec) / MARKER).unlink(missing_ok=True)
    progress = Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=quiet, transient=True)
    tasks: dict[str, TaskID] = {}

    def report(what: str, done: int, total: int) -> None:
        if what not in tasks:
            tasks[what] = progress.add_task(what, total=total)
        progress.update(tasks[what], completed=done)

    with progress:
        return ensure_demo_model(spec, report)


def register(app: typer.Typer) -> None:
    @app.command("init-demo")
    def init_demo(
        digits: Annotated[int, typer.Option(help="digits per operand of the arithmetic task")] = 1,
        ops: Annotated[str, typer.Option(help="operators of the task, from + - *")] = "+",
        force: Annotated[bool, typer.Option("--force", help="rebuild even if it exists")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print the build report as JSON")] = False,
    ) -> None:
        """Build the demo model `staleflow up` trains: a tokenizer trained on the task, a tiny Qwen2,
        a short supervised warm-up (no downloads). Kept in $STALEFLOW_CACHE or ~/.cache/staleflow."""
        if not 1 <= digits <= 12 or not ops or set(ops) - set("+-*"):
            raise fail(f"invalid task: digits={digits}, ops={ops!r}", "use 1-12 digits and operators from '+-*'")
        from staleflow.training.demo import RESPONSE_BUDGET

        directory, info = build_with_progress(digits, ops, force, quiet=as_json)
        if as_json:
            print(json.dumps({"path": str(directory), **info}))
            return
        console.print(f"demo model: {directory}")
        console.print(f"  {info['parameters']:,} parameters; warm-up {info['spec']['sft_steps']} steps in "
                      f"{info['sft_seconds']:.0f} s, loss {info['sft_loss_last']:.3f}; starting point on fresh "
                      f"problems: mean reward {info['sampled_reward']:.2f} sampled within {RESPONSE_BUDGET} tokens, "
                      f"{info['concise_share']:.0%} of answers direct, arithmetic {info['boxed_greedy_accuracy']:.0%} "
                      "right (greedy)")

    @app.command("rewards")
    def rewards(
        runs: Annotated[list[Path], typer.Argument(help="state directories of `staleflow up` runs")],
        out: Annotated[Path, typer.Option("--out", help="PNG to write")] = Path("rewards.png"),
        as_json: Annotated[bool, typer.Option("--json", help="print the curves as JSON")] = False,
    ) -> None:
        """Compare the reward curves of several runs (e.g. eta 0, 1, 2) in one plot and a table."""
        from dataclasses import asdict

        from rich.table import Table

        from staleflow.report import plot_rewards
        from staleflow.training.role import StepLog

        curves: dict[str, list[dict]] = {}
        for run in runs:
            steps = StepLog(run / "trainer" / "steps.jsonl").read()
            if not steps:
                raise fail(f"{run} has no trained steps", "give state directories of `staleflow up` runs (--state-dir)")
            job = json.loads((run / "job.json").read_text()) if (run / "job.json").exists() else {}
            label = f"{run.name} (eta = {job.get('ledger', {}).get('eta', '?')})"
            curves[label] = [asdict(s) for s in steps]
        plot_rewards(out, curves)
        if as_json:
            print(json.dumps({"plot": str(out), "runs": {k: [s["mean_reward"] for s in v] for k, v in curves.items()}}))
            return
        table = Table(title=f"mean reward per step (plot: {out})")
        for col in ("run", "steps", "first 5", "last 5", "change"):
            table.add_column(col, justify="left" if col == "run" else "right")
        for label, steps in curves.items():
            first = sum(s["mean_reward"] for s in steps[:5]) / len(steps[:5])
            last = sum(s["mean_reward"] for s in steps[-5:]) / len(steps[-5:])
            table.add_row(label, str(len(steps)), f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}")
        console.print(table)
