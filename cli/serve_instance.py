"""``staleflow serve instance``: run one rollout instance server in the foreground."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError

from staleflow.servers.instance import InstanceConfig


def _parse_assignments(assignments: list[str], option: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are parsed as JSON when they can be (numbers, true/false)."""
    result: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        try:
            result[key] = json.loads(raw)
        except json.JSONDecodeError:
            result[key] = raw
    return result


def build_config(
    *,
    config_file: Path | None,
    engine: str | None,
    instance_id: str | None,
    host: str | None,
    port: int | None,
    sim_options: dict[str, Any],
    vllm_options: dict[str, Any],
    callback_url: str | None,
    progress_url: str | None = None,
) -> InstanceConfig:
    """Merge a config file (YAML or JSON) with command-line options; options win."""
    data: dict[str, Any] = {}
    if config_file is not None:
        loaded = yaml.safe_load(config_file.read_text())
        if not isinstance(loaded, dict):
            raise typer.BadParameter(f"{config_file} must hold a mapping of InstanceConfig fields", param_hint="--config")
        data = loaded
    for key, value in (("engine", engine), ("instance_id", instance_id), ("host", host), ("port", port),
                       ("completion_callback_url", callback_url), ("progress_url", progress_url)):
        if value is not None:
            data[key] = value
    if sim_options:
        data["sim"] = {**(data.get("sim") or {}), **sim_options}
    if vllm_options:
        data["vllm"] = {**(data.get("vllm") or {}), **vllm_options}
    return InstanceConfig.model_validate(data)


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors())


def register(serve_app: typer.Typer) -> None:
    """Add the ``instance`` command to the ``serve`` command group."""

    @serve_app.command("instance")
    def serve_instance(
        engine: Annotated[str | None, typer.Option("--engine", help="sim or vllm")] = None,
        instance_id: Annotated[str | None, typer.Option("--instance-id", help="unique id of this instance")] = None,
        host: Annotated[str | None, typer.Option(help="listen address (default 127.0.0.1)")] = None,
        port: Annotated[int | None, typer.Option(help="listen port (0: any free port)")] = None,
        config: Annotated[Path | None, typer.Option("--config", exists=True, dir_okay=False,
                                                    help="YAML/JSON InstanceConfig; options override it")] = None,
        clock: Annotated[str | None, typer.Option(help="sim: real or virtual")] = None,
        speed: Annotated[float | None, typer.Option(help="sim: simulated seconds per real second")] = None,
        seed: Annotated[int | None, typer.Option(help="sim: noise seed")] = None,
        noise: Annotated[float | None, typer.Option(help="sim: sigma of the step-latency noise")] = None,
        workload: Annotated[str | None, typer.Option(help="sim: paper-20k, paper-40k or ci-tiny")] = None,
        kv_budget: Annotated[float | None, typer.Option(help="sim: KV budget M in tokens")] = None,
        sim_set: Annotated[list[str] | None, typer.Option("--sim-set", help="sim: any SimConfig field, KEY=VALUE")] = None,
        model: Annotated[str | None, typer.Option(help="vllm: local model directory")] = None,
        dtype: Annotated[str | None, typer.Option(help="vllm: bfloat16, float16 or float32")] = None,
        max_model_len: Annotated[int | None, typer.Option(help="vllm: prompt + response limit")] = None,
        vllm_set: Annotated[
            list[str] | None, typer.Option("--vllm-set", help="vllm: any VllmConfig field, KEY=VALUE")
        ] = None,
        callback_url: Annotated[str | None, typer.Option(help="POST completed trajectories here")] = None,
        progress_url: Annotated[str | None, typer.Option(
            help="POST progress checkpoints of running trajectories here (the trajectory server's /v1/progress)")] = None,
        log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    ) -> None:
        """Serve one rollout instance (engine sim or vllm) until interrupted."""
        from staleflow.servers.http import serve_forever
        from staleflow.servers.instance import create_app

        sim_options = _parse_assignments(sim_set or [], "--sim-set")
        for key, value in (("clock", clock), ("speed", speed), ("seed", seed), ("noise", noise),
                           ("workload", workload), ("kv_budget", kv_budget)):
            if value is not None:
                sim_options[key] = value
        vllm_options = _parse_assignments(vllm_set or [], "--vllm-set")
        for key, value in (("model", model), ("dtype", dtype), ("max_model_len", max_model_len)):
            if value is not None:
                vllm_options[key] = value
        try:
            instance = build_config(
                config_file=config, engine=engine, instance_id=instance_id, host=host, port=port,
                sim_options=sim_options, vllm_options=vllm_options, callback_url=callback_url,
                progress_url=progress_url,
            )
        except ValidationError as exc:
            raise typer.BadParameter(_describe(exc)) from None
        serve_forever(create_app(instance), instance.host, instance.port, log_level=log_level)


__all__ = ["build_config", "register"]
