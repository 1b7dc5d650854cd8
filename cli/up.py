"""``staleflow up``: run a whole job on this machine, observable while it runs."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from staleflow.cli.common import console, fail, flag_names, validation_failure
from staleflow.config import JobConfig
from staleflow.config.files import SettingsFileError, read_settings_file


def load_config_file(path: Path) -> dict[str, Any]:
    try:
        return read_settings_file(path)
    except SettingsFileError as exc:
        raise fail(str(exc)) from None


def job_config(file: Path | None, **flags: Any) -> JobConfig:
    """The job: the file's settings, then the flags given (each named after the setting it sets,
    flat: ``JobConfig.flat_settings`` says where it goes). Errors name the field, its flag and the fix."""
    data = load_config_file(file) if file else {}
    backends = flags.pop("logger", None)
    if backends is not None:  # the flag names the backends; the file's other logger settings stay
        section = data.get("logger")
        chosen = [name.strip() for name in backends.split(",") if name.strip()]
        data["logger"] = {**section, "backends": chosen} if isinstance(section, dict) else chosen
    data.update({k: v for k, v in flags.items() if v is not None})
    try:
        config = JobConfig.model_validate(data)
    except ValidationError as exc:
        names = {**flag_names(flags, JobConfig.flat_settings), "logger.backends": "--logger"}
        raise validation_failure(exc, names, JobConfig, complete_flags=True) from None
    if config.calibration is not None:  # read before anything starts (the coordinator reads it again)
        from staleflow.calibration import CalibrationError, referenced_entry

        try:
            referenced_entry(config.calibration)
        except CalibrationError as exc:
            raise fail(f"invalid configuration:\n  coordinator.calibration (--calibration): {exc}",
                       "point --calibration (or calibration.file) at a file `staleflow calibrate` wrote, naming "
                       "one of its entries") from None
    return config


def _view(config: JobConfig, progress: Progress, sample: Any, steps: list, restarts: list[dict]) -> Group:
    instances = Table(title="rollout instances", expand=False)
    for col in ("instance", "status", "version", "running", "waiting", "est. tokens/s"):
        instances.add_column(col, justify="right" if col not in ("instance", "status") else "left")
    if sample:
        for name, i in sorted(sample.instances.items()):
            instances.add_row(name, i["status"], str(i["version"]), str(i["running"]), str(i["waiting"]),
                              f"{i['throughput']:.0f}")
    buffers = Table(title="staleness buffers")
    for col in ("buffer", "state", "occupied", "reserved"):
        buffers.add_column(col)
    if sample:
        for b in sample.buffers:
            occ = sum(e["status"] == "occupied" for e in b["entries"])
            buffers.add_row(str(b["version"]), b["state"], str(occ), str(len(b["entries"]) - occ))
    tokens = sum(s.response_tokens for s in steps)
    stale: dict[int, int] = {}
    for s in steps:
        for k, n in s.staleness.items():
            stale[k] = stale.get(k, 0) + n
    elapsed = steps[-1].finished_at if steps else 0.0
    sim = elapsed * config.speed if config.engine == "sim" else elapsed
    line = (f"trained tokens {tokens:,}  |  {tokens / sim:,.0f} tokens/s" if sim else "waiting for the first batch") + (
        f"  |  staleness so far {dict(sorted(stale.items()))} (bound {config.ledger.eta})")
    return Group(progress, instances, buffers, line, *([_restarts_line(restarts)] if restarts else []))


def _restarts_line(restarts: list[dict]) -> str:
    """The supervisor's restarts so far, newest last (the live view shows the last few)."""
    shown = [f"{r['component']} ({r['cause']}, {_back(r)})" for r in restarts[-4:]]
    more = f"{len(restarts) - 4} earlier, " if len(restarts) > 4 else ""
    return f"restarts: {more}{'; '.join(shown)}"


def _back(restart: dict) -> str:
    if restart["recovered_after_s"] is not None:
        return f"back in {restart['recovered_after_s']:.1f}s"
    return restart["error"] or "not restarted"


def run_up(config: JobConfig, resume: bool, fresh: bool, json_log: bool, launcher: str = "local",
           namespace: str | None = None, ray_address: str | None = None) -> int:
    from staleflow.servers.auth import private_files

    with private_files(config.state_dir):  # the ledger, trajectories, logs and weights: owner-only from creation
        return _run_up(config, resume, fresh, json_log, launcher, namespace, ray_address)


def _run_up(config: JobConfig, resume: bool, fresh: bool, json_log: bool, launcher: str,
            namespace: str | None, ray_address: str | None) -> int:
    from staleflow.launch.plan import trainer_label
    from staleflow.launch.views import JobTracking, job_summary
    from staleflow.tracking import missing_backends

    missing = missing_backends(config.logger.backends)
    if missing:
        raise fail("; ".join(missing), "or drop those backends from the logger setting (--logger)")

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        filename=str(config.state_dir / "job.log") if config.state_dir.exists() else None)
    job = _open_job(config, resume, fresh, launcher, namespace, ray_address)
    signals: dict[str, int | None] = {"received": None}

    def on_signal(signum: int, _frame: Any) -> None:
        signals["received"] = signum
        job.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    emit = (lambda obj: print(json.dumps(obj), flush=True)) if json_log else None
    note = f"{config.engine} engine, {trainer_label(config)}" + (f"; clock x{config.speed}" if config.engine == "sim" else "")
    emit({"event": "start", "note": note}) if emit else console.print(f"[bold]StaleFlow[/] — {note}")
    job.write_planned_endpoints()

    def started(name: str, url: str) -> None:
        emit({"event": "component", "name": name, "url": url}) if emit else console.print(f"  {name:<12} {url}")

    try:  # before the trainer starts, so the first step is logged too
        tracking = JobTracking(job, (lambda line: emit({"event": "step", "text": line})) if emit else console.print)
    except Exception as exc:
        raise fail(f"could not start the logger: {exc}", "check the logger setting (--logger)") from None
    if not emit and set(config.logger.backends) - {"console"}:
        console.print(f"  tracking    {tracking.directory}")
    try:
        job.start(started)
    except Exception as exc:  # a launcher's own errors say what to change; others name the logs
        tracking.close()
        job.shutdown()
        raise fail(f"could not start the job: {exc}", f"see the logs in {config.state_dir / 'logs'}") from None
    if not emit:
        console.print(f"  endpoints   {config.state_dir / 'endpoints.json'}")
    restarts = _follow(job, config, tracking, emit)
    failure = job.failure
    summary = job_summary(job, config, restarts, failure)
    trainer_error = job.trainer_error
    job.shutdown(release_state_dir=False)  # the report is written while this `up` still owns the directory
    try:
        return _conclude(job, config, summary, restarts, failure, trainer_error, signals["received"], emit)
    finally:
        job.state_lock.release()


def _open_job(config: JobConfig, resume: bool, fresh: bool, launcher: str, namespace: str | None,
              ray_address: str | None) -> Any:
    """The launcher's job, its state directory taken; what refuses it is a clear failure."""
    from staleflow.database_url import DatabaseUrlError
    from staleflow.launch.local import LocalJob
    from staleflow.launch.state_lock import StateDirInUse
    from staleflow.servers.db import DatabaseError

    try:
        if launcher == "ray":  # imported only here: a local run never loads Ray
            from staleflow.launch.ray.common import LauncherError
            from staleflow.launch.ray.job import RayClusterJob

            try:
                return RayClusterJob(config, resume=resume, fresh=fresh, address=ray_address, namespace=namespace)
            except LauncherError as exc:
                raise fail(str(exc)) from None
        return LocalJob(config, resume=resume, fresh=fresh)
    except (StateDirInUse, DatabaseError, DatabaseUrlError) as exc:
        raise fail(str(exc)) from None


def _follow(job: Any, config: JobConfig, tracking: Any, emit: Any) -> list[dict]:
    """Show the running job (a live view, plain lines, or JSON events) and track its steps until it
    finishes or stops; returns every restart the supervisor recorded."""
    progress = Progress(TextColumn("training steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    task = progress.add_task("steps", total=config.steps)
    live = None if emit or not sys.stdout.isatty() else Live(console=console, refresh_per_second=4)
    if live:
        live.start()
    restarts_shown = 0

    def show_restarts() -> list[dict]:
        nonlocal restarts_shown
        restarts = job.restarts  # every launcher's supervisor records them alike
        for r in restarts[restarts_shown:]:
            if emit:
                emit({"event": "restart", **r})
            elif not live:
                console.print(f"  restart  {r['component']}: {r['cause']}; {_back(r)}")
        restarts_shown = len(restarts)
        return restarts

    try:
        while not job.finished() and not job.stop.is_set():
            sample = job.monitor.sample()
            steps = job.steps()
            tracking.update(steps, sample)
            done = len(steps)
            progress.update(task, completed=min(done, config.steps))
            restarts = show_restarts()
            if emit and sample:
                emit({"event": "sample", "t": sample.t, "train_version": sample.train_version,
                      "instances": sample.instances, "buffers": [b["state"] for b in sample.buffers]})
            elif live:
                live.update(_view(config, progress, sample, steps, restarts))
            job.stop.wait(0.25)  # refresh pacing
        tracking.update(job.steps(), job.monitor.samples[-1] if job.monitor.samples else None, final=True)
    finally:
        if live:
            live.stop()
        tracking.close()
    return show_restarts()


def _conclude(job: Any, config: JobConfig, summary: dict, restarts: list[dict], failure: str | None,
              trainer_error: str | None, received: int | None, emit: Any) -> int:
    """The end of a run: the report, the last words, the exit status."""
    from staleflow.launch.views import write_job_report
    from staleflow.report import length_skew_line

    completed = (trainer_error is None and failure is None and received is None
                 and len(job.steps()) >= config.steps)
    written = write_job_report(config, summary, job.monitor.samples, completed)
    if emit:
        emit({"event": "end", "completed": completed, "report": [str(p) for p in written],
              "tokens_per_second": summary["tokens_per_second"], "staleness_violations": summary["staleness_violations"],
              "restarts": len(restarts), **({"failure": failure} if failure else {})})
    else:
        console.print(f"{'finished' if completed else 'stopped'}: {summary['steps']} steps, "
                      f"{summary['response_tokens']:,} tokens, {summary['tokens_per_second']:,.0f} tokens/s "
                      f"({summary['clock']}); staleness violations: {summary['staleness_violations']}")
        console.print(f"  state   {config.state_dir.resolve()}")
        console.print(f"  logs    {(config.state_dir / 'logs').resolve()}")
        console.print(f"  report  {written[0].parent.resolve()}")
        if summary["length_skew"]:
            console.print(f"  {length_skew_line(summary['length_skew'])}")
        if restarts:
            console.print(f"  restarts {len(restarts)}: " + ", ".join(f"{r['component']} ({r['cause']})" for r in restarts))
    if failure is not None:
        raise fail(f"the job stopped: {failure}", "fix what the log shows, then continue with: staleflow up --resume"
                   + (f" --state-dir {config.state_dir}" if str(config.state_dir) != ".staleflow" else ""), code=1)
    if trainer_error is not None:
        raise fail(f"the trainer failed: {trainer_error}", f"see {config.state_dir / 'job.log'} and {config.state_dir / 'logs'}",
                   code=1)
    if not completed:
        if not emit:
            console.print("resume with: staleflow up --resume" + (f" --state-dir {config.state_dir}"
                                                                   if str(config.state_dir) != ".staleflow" else ""))
        return 128 + (received or 0)
    return 0


def prepare_real_job(config: JobConfig) -> None:
    """Check the real job's packages and model, or build the demo model, before anything starts."""
    from staleflow.launch.prepare import JobNotReady, check_model_directory, check_real_job_packages

    try:
        check_real_job_packages()
        if config.model is not None:
            check_model_directory(config.model)
    except JobNotReady as exc:
        raise fail(exc.message, exc.fix) from None
    if config.model is None:
        from staleflow.cli.demo import build_with_progress

        directory, info = build_with_progress(config.task.digits, config.task.ops)
        console.print(f"  model       demo Qwen2 ({info['parameters']:,} parameters; after warm-up: mean reward "
                      f"{info['sampled_reward']:.2f} sampled, {info['concise_share']:.0%} direct answers) at {directory}")


def _serve_trainer(config: JobConfig, endpoints: dict) -> int:
    import os
    import threading

    from staleflow.launch.plan import STARTED_ENV, run_trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    started = float(os.environ[STARTED_ENV]) if STARTED_ENV in os.environ else None
    run_trainer(config, endpoints, stop, started)
    return 0


def register(app: typer.Typer, serve_app: typer.Typer) -> None:
    @app.command()
    def up(
        config: Annotated[Path | None, typer.Option("--config", help="YAML/TOML/JSON job file; flags override it")] = None,
        engine: Annotated[str | None, typer.Option(help="sim or vllm")] = None,
        steps: Annotated[int | None, typer.Option(help="training steps to run")] = None,
        state_dir: Annotated[Path | None, typer.Option("--state-dir", help="state, logs and report")] = None,
        eta: Annotated[int | None, typer.Option(help="staleness bound")] = None,
        batch_size: Annotated[int | None, typer.Option("--batch-size", help="prompt groups per batch")] = None,
        group_size: Annotated[int | None, typer.Option("--group-size", help="trajectories per group")] = None,
        instances: Annotated[int | None, typer.Option(help="rollout instances")] = None,
        routing: Annotated[str | None, typer.Option(help="throughput or vanilla")] = None,
        sync: Annotated[str | None, typer.Option(help="selective, greedy or global")] = None,
        migration: Annotated[str | None, typer.Option(help="starved, throughput, repack, both (throughput and "
                                                            "repack), starved+repack or none")] = None,
        workload: Annotated[str | None, typer.Option(help="sim workload preset")] = None,
        model: Annotated[Path | None, typer.Option(help="vllm: local model directory (default: the demo model)")] = None,
        trainer_ranks: Annotated[int | None, typer.Option("--trainer-ranks", help="vllm: FSDP2 ranks")] = None,
        max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="response length limit")] = None,
        progress_tokens: Annotated[int | None, typer.Option(
            "--progress-tokens", help="checkpoint running trajectories every this many tokens (0: never)")] = None,
        seed: Annotated[int | None, typer.Option(help="random seed")] = None,
        speed: Annotated[float | None, typer.Option(help="sim clock speed-up")] = None,
        base_port: Annotated[int | None, typer.Option("--base-port", help="first component port (0: free ports)")] = None,
        processes: Annotated[bool | None, typer.Option("--processes/--embedded", help="one process per component")] = None,
        resume: Annotated[bool, typer.Option("--resume", help="continue the run in --state-dir")] = False,
        fresh: Annotated[bool, typer.Option("--fresh", help="discard an unfinished run in --state-dir")] = False,
        json_log: Annotated[bool, typer.Option("--json-log", help="JSON lines instead of the live view")] = False,
        calibration: Annotated[Path | None, typer.Option(
            help="`staleflow calibrate` file for the coordinator's cost model (one model in it)")] = None,
        logger: Annotated[str | None, typer.Option(
            help="per-step metrics to: console, tensorboard, wandb, mlflow (comma-separated)")] = None,
        launcher: Annotated[str, typer.Option(help="local (this machine) or ray (a Ray cluster; extra [ray])")] = "local",
        namespace: Annotated[str | None, typer.Option(help="ray: the job's Ray namespace (default: cluster.namespace, "
                                                           "else staleflow-<state dir name>)")] = None,
        ray_address: Annotated[str | None, typer.Option("--ray-address", help="ray: cluster address "
                                                                             "(default: cluster.address, $RAY_ADDRESS, auto)")] = None,
    ) -> None:
        """Run StaleFlow on this machine: every component, a short RL job, a report at the end."""
        job = job_config(config, engine=engine, steps=steps, state_dir=state_dir, eta=eta, batch_size=batch_size,
                         group_size=group_size, instances=instances, routing=routing, sync=sync, migration=migration,
                         workload=workload, max_tokens=max_tokens, progress_tokens=progress_tokens, seed=seed, speed=speed,
                         base_port=base_port,
                         processes=processes, model=model, trainer_ranks=trainer_ranks, logger=logger,
                         calibration={"file": str(calibration)} if calibration else None)
        if launcher not in ("local", "ray"):
            raise fail(f"--launcher {launcher!r} is not a launcher", "use --launcher local or --launcher ray")
        if job.engine == "vllm":
            prepare_real_job(job)
        raise typer.Exit(run_up(job, resume, fresh, json_log, launcher, namespace, ray_address))

    @serve_app.command("component")
    def serve_component(
        name: Annotated[str, typer.Argument(help="manager, params, reward, ts, inst-N, coordinator or trainer")],
        job: Annotated[Path, typer.Option("--job", help="the job file `staleflow up` wrote")],
        endpoints: Annotated[Path, typer.Option("--endpoints", help="the planned endpoints file")],
    ) -> None:
        """One component of a `staleflow up` job, in its own process (used by `up --processes`)."""
        from staleflow.launch.plan import TRAINER, build_app
        from staleflow.servers.http import serve_forever

        try:
            config = JobConfig.model_validate_json(job.read_text())
            planned = json.loads(endpoints.read_text())
            if name == TRAINER:
                raise typer.Exit(_serve_trainer(config, planned))
            app = build_app(name, config, planned)
        except (OSError, ValueError, ValidationError) as exc:
            raise fail(f"cannot start component {name}: {exc}") from None
        from staleflow.servers.auth import InsecureBind

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            serve_forever(app, planned[name]["host"], planned[name]["port"], log_level="warning")
        except InsecureBind as exc:
            raise fail(str(exc)) from None
