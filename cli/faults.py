"""``staleflow faults``: run a job, kill its roles one at a time, report detection, recovery, ETTR."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from staleflow.cli.common import console, fail
from staleflow.cli.up import job_config

DEFAULT_ROLES = "instance,ts,params,manager,coordinator,trainer,instance"


def register(app: typer.Typer) -> None:
    @app.command()
    def faults(
        roles: Annotated[str, typer.Option(help="roles to kill in turn: instance, ts, params, manager, coordinator, "
                                                "trainer, reward")] = DEFAULT_ROLES,
        every: Annotated[int, typer.Option(help="inject a fault every this many training steps")] = 3,
        hang: Annotated[bool, typer.Option("--hang/--no-hang", help="every second instance fault is a hang "
                                                                     "(SIGSTOP), not a crash")] = True,
        steps: Annotated[int | None, typer.Option(help="training steps (default: enough for every fault)")] = None,
        baseline: Annotated[bool, typer.Option("--baseline/--no-baseline",
                                               help="also run without faults, for the ETTR")] = True,
        config: Annotated[Path | None, typer.Option("--config", help="job file, as for `staleflow up`")] = None,
        state_dir: Annotated[Path, typer.Option("--state-dir", help="where the runs keep their state")] = Path(
            ".staleflow-faults"),
        instances: Annotated[int | None, typer.Option(help="rollout instances")] = None,
        workload: Annotated[str | None, typer.Option(help="sim workload preset")] = None,
        speed: Annotated[float | None, typer.Option(help="sim clock speed-up")] = None,
        max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="response length limit")] = None,
        progress_tokens: Annotated[int | None, typer.Option(
            "--progress-tokens", help="instances checkpoint running trajectories every this many tokens (0: never)")] = None,
        deadline: Annotated[float, typer.Option(help="give up on a run after this many seconds")] = 300.0,
        output: Annotated[Path | None, typer.Option("--output", help="write the report (JSON) here")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    ) -> None:
        """Kill one role at a time (SIGKILL) during a running job; only that role restarts. Reports
        per role the detection time, recovery time, rollout throughput kept during the outage, the
        ETTR against a fault-free run, and the invariants checked after the run."""
        from staleflow.launch.faults import FaultRun, summarize, write_report
        from staleflow.report import length_skew_line

        wanted = [r.strip() for r in roles.split(",") if r.strip()]
        if every < 1:
            raise fail("--every must be at least 1", "inject at most one fault per training step")
        defaults = {"engine": "sim", "workload": "ci-tiny", "instances": 3, "speed": 20.0, "max_tokens": 48, "batch_size": 4,
                    "group_size": 2, "eta": 1}
        flags = {"workload": workload, "instances": instances, "speed": speed, "steps": steps,
                 "max_tokens": max_tokens, "progress_tokens": progress_tokens}
        if config is None:
            flags = {**defaults, **{k: v for k, v in flags.items() if v is not None}}
        cfg = job_config(config, **flags, processes=True, state_dir=state_dir / "faulty")
        if steps is None and config is None:
            cfg = cfg.model_copy(update={"steps": max(every, 6) * (len(wanted) + 2)})  # a standby warms between faults
        logging.basicConfig(level=logging.ERROR)
        say = (lambda m: None) if as_json else (lambda m: console.print(f"  {m}"))
        base = None
        try:
            if baseline:
                say(f"fault-free run: {cfg.steps} steps")
                base = FaultRun(cfg.model_copy(update={"state_dir": state_dir / "baseline"}), [],
                                deadline_s=deadline).run(say)
            say(f"faulty run: {cfg.steps} steps, a fault every {every} steps: {', '.join(wanted)}")
            faulty = FaultRun(cfg, wanted, every=every, hang_instance=hang, deadline_s=deadline).run(say)
        except ValueError as exc:
            raise fail(str(exc)) from None
        report = summarize(base, faulty)
        report["fault_every_steps"] = every
        report["command"] = "staleflow faults " + " ".join(f"--{k} {v}" for k, v in (("roles", roles), ("every", every)))
        report["progress_tokens"] = cfg.instance.progress_tokens
        if output:
            write_report(output, report)
        if as_json:
            typer.echo(json.dumps(report, default=str))
        else:
            table = Table(title=f"faults: one every {every} steps, {faulty.steps} steps")
            for col in ("role", "faults", "detection s", "recovery s", "throughput kept"):
                table.add_column(col, justify="left" if col == "role" else "right")
            for role, r in report["per_role"].items():
                fmt = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
                table.add_row(role, str(r["faults"]), fmt(r["detection_s"]), fmt(r["recovery_s"]),
                              fmt(r["throughput_kept"], "{:.0%}"))
            console.print(table)
            console.print(f"ETTR {report['ettr']:.1%}: {faulty.steps} steps at the run's own fault-free pace "
                          f"({report['pace_s']:.2f}s a step) over {report['faulty_wall_s']:.1f}s with faults")
            if report["ettr_vs_baseline"] is not None:
                console.print(f"  against a fault-free run: {report['ettr_vs_baseline']:.1%} "
                              f"({report['baseline_wall_s']:.1f}s vs {report['faulty_wall_s']:.1f}s)")
            lost = report["regenerated_tokens"]
            if lost["trajectories"]:
                console.print(f"tokens regenerated per trajectory on a failed instance: mean "
                              f"{lost['per_trajectory_mean']:.0f}, max {lost['per_trajectory_max']} over "
                              f"{lost['trajectories']} trajectories (" + (
                                  f"progress checkpoints every {cfg.instance.progress_tokens} tokens)"
                                  if cfg.instance.progress_tokens else "no progress checkpoints)"))
            counted = lost["counted_by_trajectory_server"]
            if counted["total"] is not None:
                cycle = counted["one_cycle_tokens"]
                console.print(f"  the trajectory server counted {counted['total']} tokens regenerated over "
                              f"{counted['trajectories']} trajectories (from the coordinator's last snapshot of each "
                              "failed instance" + (f"; those trajectories generate {cycle:.0f} tokens a cycle)" if cycle else ")"))
            if report["length_skew"]:
                console.print(length_skew_line(report["length_skew"]))
            console.print("checks: " + ", ".join(f"{k}={v}" for k, v in report["checks"].items()))
            for violation in report["violations"]:
                console.print(f"[red]violation[/]: {violation}")
        if report["violations"]:
            raise typer.Exit(1)
