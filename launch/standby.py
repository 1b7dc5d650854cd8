"""A warm standby: a process that has already imported every component's code and waits on
stdin for the role to take (``{"name", "job", "endpoints"}`` as one JSON line), then serves it.

The supervisor keeps one ready (with `--processes`) so a failed role restarts without a cold start (imports
alone take seconds on a loaded machine); cf. RobustRL's warm standbys."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path


def spawn(log_path: Path) -> subprocess.Popen:
    """Start a standby; its output goes to ``log_path`` until it takes a role (then the role's
    log). ``ready(log_path)`` tells when it has finished importing."""
    log_file = log_path.open("a")
    return subprocess.Popen([sys.executable, "-m", "staleflow.launch.standby", str(log_path)],
                            stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, text=True)


def ready(log_path: Path) -> bool:
    return log_path.with_suffix(".ready").exists()


def main() -> int:
    import os

    # imported before the process waits: a standby is warm once it is taken
    import staleflow.coordinator.app
    import staleflow.servers.instance
    import staleflow.servers.manager
    import staleflow.servers.params
    import staleflow.servers.reward
    import staleflow.servers.trajectories
    import staleflow.training.role  # noqa: F401
    from staleflow.config import JobConfig
    from staleflow.launch.plan import TRAINER, build_app, run_trainer
    from staleflow.servers.http import serve_forever

    if len(sys.argv) > 1:
        Path(sys.argv[1]).with_suffix(".ready").touch()
    line = sys.stdin.readline()
    if not line:
        return 0  # released unused
    role = json.loads(line)
    name = role["name"]
    # from now on this process is the role: write to the role's log like a cold-started one
    config = JobConfig.model_validate_json(Path(role["job"]).read_text())
    log_fd = os.open(config.state_dir / "logs" / f"{name}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    planned = json.loads(Path(role["endpoints"]).read_text())
    if name == TRAINER:  # as `staleflow serve component trainer` does
        import signal
        import threading

        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        run_trainer(config, planned, stop, role.get("started"))
        return 0
    serve_forever(build_app(name, config, planned), planned[name]["host"], planned[name]["port"], log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
