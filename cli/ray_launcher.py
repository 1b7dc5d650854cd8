"""The command line's side of the Ray launcher: finding a job by its Ray namespace, `staleflow down`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from staleflow.cli.common import DEFAULT_STATE_DIR, console, endpoints, fail

Launcher = Annotated[str, typer.Option(help="local (the job in --state-dir) or ray (the job in a Ray namespace)")]
Namespace = Annotated[str | None, typer.Option(help="ray: the job's Ray namespace (default: the one in "
                                                    "--state-dir's endpoints.json)")]
RayAddress = Annotated[str | None, typer.Option("--ray-address", help="ray: cluster address (default: $RAY_ADDRESS, auto)")]


def _namespace(namespace: str | None, state_dir: Path) -> str:
    found = namespace or endpoints(state_dir).get("namespace")
    if not found:
        raise fail("which job? no --namespace given and no Ray job in " + str(state_dir),
                   "pass --namespace (the job's Ray namespace, printed by `staleflow up --launcher ray`)")
    return found


def job_endpoints(launcher: str, namespace: str | None, address: str | None, state_dir: Path) -> dict | None:
    """The endpoints of a job on a Ray cluster (from its registry actor), or None for a local job."""
    if launcher == "local":
        return None
    if launcher != "ray":
        raise fail(f"--launcher {launcher!r} is not a launcher", "use --launcher local or --launcher ray")
    from staleflow.launch.ray.common import LauncherError, registry_endpoints

    try:
        return registry_endpoints(address or endpoints(state_dir).get("ray_address"), _namespace(namespace, state_dir))
    except LauncherError as exc:
        raise fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    @app.command()
    def down(namespace: Namespace = None, ray_address: RayAddress = None,
             state_dir: Annotated[Path, typer.Option("--state-dir", help="the run's state directory")] = DEFAULT_STATE_DIR,
             ) -> None:
        """Stop a job on a Ray cluster: kill its actors and remove its placement groups."""
        from staleflow.launch.ray.common import LauncherError, connect, remove_job

        ns = _namespace(namespace, state_dir)
        try:
            ray = connect(ray_address or endpoints(state_dir).get("ray_address"), ns)
        except LauncherError as exc:
            raise fail(str(exc)) from None
        removed = remove_job(ray, ns)
        console.print(f"namespace {ns}: killed {len(removed['actors'])} actors "
                      f"({', '.join(sorted(removed['actors'])) or 'none'}), removed placement groups "
                      f"{', '.join(removed['placement_groups']) or 'none'}")
