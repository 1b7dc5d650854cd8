"""``staleflow serve params``: the parameter server in the foreground.

Also runnable on its own (``python -m staleflow.cli.serve_params ...``) with the same options."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from staleflow.cli.common import fail, flag_names, validation_failure
from staleflow.config import ParamsConfig, default_of

OPTIONS = ("state_dir", "keep", "transports", "host", "port", "data_port", "shm_dir", "fsync", "holder_of", "holder_id",
           "zone", "spot", "retain", "retain_replicas", "holder_follows", "egress_gbps",
           "peer_transport", "emulated_host")
"""Options named after the setting they set; ``--chunk-mb`` and ``--lease-ttl`` are named apart."""
NO_DATA_PLANE = -1


def serve_owning(resource: Any, app: Any, host: str, port: int, token: str | None) -> None:
    """Serve ``app`` in the foreground. ``resource`` (a store, a worker pool) was opened before it,
    so that one that cannot open fails with its own message; the app closes it at shutdown (it
    must own it: uvicorn re-raises the stop signal), this closes it if serving never started."""
    from staleflow.servers.auth import InsecureBind
    from staleflow.servers.http import serve_forever

    try:
        serve_forever(app, host, port, token=token)
    except (OSError, InsecureBind) as exc:
        raise fail(str(exc)) from None
    finally:
        resource.close()


def params_config(state_dir: Path, keep: int, chunk_mb: float, transports: str, host: str, port: int,
                  shm_dir: Path, fsync: bool, lease_ttl_s: float, persist: bool = True, data_port: int = 0,
                  egress_gbps: float | None = None, **reference: Any) -> ParamsConfig:
    """``reference``: the reference-oriented storage settings (``holder_of``, ``retain``, ...)."""
    try:
        return ParamsConfig.model_validate(dict(  # the transports' names are validated there
            state_dir=state_dir, keep=keep, chunk_bytes=int(chunk_mb * (1 << 20)),
            transports=tuple(t.strip() for t in transports.split(",") if t.strip()),
            host=host, port=port, shm_dir=shm_dir, fsync=fsync, lease_ttl_s=lease_ttl_s, persist=persist,
            data_port=None if data_port == NO_DATA_PLANE else data_port, egress_gbps=egress_gbps, **reference,
        ))
    except ValidationError as exc:
        names = {**flag_names(OPTIONS), "chunk_bytes": "--chunk-mb", "lease_ttl_s": "--lease-ttl", "holder_ttl_s": "--holder-ttl"}
        raise validation_failure(exc, names) from None


def register(serve_app: typer.Typer) -> None:
    @serve_app.command("params")
    def serve_params(
        state_dir: Annotated[Path, typer.Option("--state-dir", help="where versions are stored")] = default_of(ParamsConfig, "state_dir"),
        keep: Annotated[int, typer.Option(help="complete versions kept (the newest K)")] = default_of(ParamsConfig, "keep"),
        chunk_mb: Annotated[float, typer.Option("--chunk-mb", help="chunk size in MiB (per-request payload limit)")]
        = default_of(ParamsConfig, "chunk_bytes") / (1 << 20),
        transports: Annotated[str, typer.Option(help="comma-separated: http,shm,nixl")] = ",".join(default_of(ParamsConfig, "transports")),
        host: Annotated[str, typer.Option(help="bind address")] = default_of(ParamsConfig, "host"),
        port: Annotated[int, typer.Option(help="bind port")] = default_of(ParamsConfig, "port"),
        data_port: Annotated[int, typer.Option("--data-port", help="port of the chunk data plane (0: any free port; "
                                                                   f"{NO_DATA_PLANE}: none, chunks go through --port)")]
        = default_of(ParamsConfig, "data_port"),
        token: Annotated[str | None, typer.Option(help="bearer token for mutating requests (default: $STALEFLOW_TOKEN)")] = None,
        shm_dir: Annotated[Path, typer.Option("--shm-dir", help="shared-memory directory")] = default_of(ParamsConfig, "shm_dir"),
        fsync: Annotated[bool, typer.Option("--fsync/--no-fsync", help="fsync each version as it is persisted")]
        = default_of(ParamsConfig, "fsync"),
        persist: Annotated[bool, typer.Option("--persist/--no-persist",
                                              help="persist versions to --state-dir in the background (crash recovery)")]
        = default_of(ParamsConfig, "persist"),
        lease_ttl_s: Annotated[float, typer.Option("--lease-ttl", help="seconds an unused pull lease lives")]
        = default_of(ParamsConfig, "lease_ttl_s"),
        egress_gbps: Annotated[float | None, typer.Option("--egress-gbps", help="egress limit in Gbit/s over every chunk "
                                                                              "body this server sends (emulates a NIC; "
                                                                              "default: none)")]
        = default_of(ParamsConfig, "egress_gbps"),
        holder_of: Annotated[str | None, typer.Option("--holder-of", help="be a holder of the parameter server at this URL: "
                                                      "pull versions from their holders, serve what is held")] = None,
        holder_id: Annotated[str | None, typer.Option("--holder-id", help="this holder's id (default: a random one)")] = None,
        zone: Annotated[str, typer.Option(help="this holder's rack or zone label")] = default_of(ParamsConfig, "zone"),
        spot: Annotated[bool, typer.Option("--spot/--no-spot", help="a preemptible holder (never counts for retention)")]
        = default_of(ParamsConfig, "spot"),
        holder_follows: Annotated[bool, typer.Option("--holder-follows/--no-holder-follows",
                                                     help="a holder pulls each new version as it appears")]
        = default_of(ParamsConfig, "holder_follows"),
        retain: Annotated[int | None, typer.Option(help="versions kept available by holders or this server (default: --keep)")]
        = default_of(ParamsConfig, "retain"),
        retain_replicas: Annotated[int, typer.Option("--retain-replicas", help="non-spot holders of a retained version "
                                                     "before this server drops its own copy")]
        = default_of(ParamsConfig, "retain_replicas"),
        holder_ttl_s: Annotated[float, typer.Option("--holder-ttl", help="seconds a silent holder lives")]
        = default_of(ParamsConfig, "holder_ttl_s"),
        peer_transport: Annotated[str, typer.Option("--peer-transport", help="how a holder reads other holders' chunks: "
                                                    "auto (shm on its host, else nixl where both offer it, else http), "
                                                    "shm, nixl or http")] = default_of(ParamsConfig, "peer_transport"),
        emulated_host: Annotated[str | None, typer.Option("--emulated-host", help="the host a holder says it runs on "
                                                          "(benchmarks: hosts of their own on one machine)")] = None,
    ) -> None:
        """The parameter server: versioned model weights, pushed by the trainer, pulled by instances."""
        from staleflow.servers.params import ParamStore, create_app
        from staleflow.transports.errors import TransportUnavailable

        config = params_config(state_dir, keep, chunk_mb, transports, host, port, shm_dir, fsync, lease_ttl_s, persist, data_port,
                               egress_gbps=egress_gbps, holder_of=holder_of, holder_id=holder_id, zone=zone, spot=spot,
                               holder_follows=holder_follows, retain=retain, retain_replicas=retain_replicas,
                               holder_ttl_s=holder_ttl_s, peer_transport=peer_transport, emulated_host=emulated_host)
        if "nixl" in config.transports:
            from staleflow.transports.nixl import nixl_available

            available, reason = nixl_available()
            if not available:
                raise fail(reason, "drop nixl from --transports or install it")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:  # open the store first: a locked or unreadable state directory stops us here
            store = ParamStore(config)
        except (OSError, TransportUnavailable) as exc:
            raise fail(str(exc)) from None
        serve_owning(store, create_app(config, store, owns_store=True), config.host, config.port, token)


if __name__ == "__main__":
    standalone = typer.Typer(add_completion=False)
    register(standalone)
    standalone(prog_name="staleflow serve params")
