"""A throwaway PostgreSQL server for the tests: ``initdb`` into a temporary directory, ``pg_ctl``
starts it on 127.0.0.1 at a free port (no Unix socket, trust authentication for loopback only),
one database per test, and ``stop()`` removes everything. Run as root (containers), the server
runs as the ``postgres`` user (or ``nobody``), since PostgreSQL refuses to run as root."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

from support import free_port

USER = "staleflow"


def find_binaries() -> Path | None:
    """The directory holding initdb/pg_ctl/postgres: $POSTGRES_BIN, PATH, or Debian's layout."""
    candidates = [os.environ.get("POSTGRES_BIN", "")]
    if (initdb := shutil.which("initdb")) is not None:
        candidates.append(str(Path(initdb).resolve().parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for directory in filter(None, candidates):
        if all((Path(directory) / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            return Path(directory)
    return None


class ThrowawayPostgres:
    def __init__(self, binaries: Path):
        self.binaries = binaries
        self.root = Path(tempfile.mkdtemp(prefix="staleflow-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.runas: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    self.runas = pwd.getpwnam(name)
                    break
                except KeyError:
                    continue
            if self.runas is None:
                raise RuntimeError("running as root and no unprivileged user (postgres, nobody) to run PostgreSQL as")
            os.chown(self.root, self.runas.pw_uid, self.runas.pw_gid)
        self.running = False

    def _run(self, tool: str, *args: str) -> None:
        kwargs = {"user": self.runas.pw_uid, "group": self.runas.pw_gid, "extra_groups": []} if self.runas else {}
        result = subprocess.run([str(self.binaries / tool), *args], capture_output=True, text=True, cwd=self.root,
                                **kwargs)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")

    def start(self) -> ThrowawayPostgres:
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        self._serve()
        return self

    def _serve(self) -> None:
        # loopback TCP only; fsync off: the tests kill StaleFlow processes, never this server
        options = f"-h 127.0.0.1 -p {self.port} -c unix_socket_directories='' -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60",
                  "-o", options, "start")
        self.running = True

    def halt(self) -> None:
        """An outage: the server stops (its sessions are cut, connections are refused), its data stays."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        self.running = False

    def resume(self) -> None:
        """The outage ends: the same server, data and port again."""
        self._serve()

    def stop(self) -> None:
        try:
            if self.running:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
                self.running = False
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres", autocommit=True)

    def create_database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{name}"

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
