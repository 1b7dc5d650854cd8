"""Helpers shared by the tests (the tests folder is on sys.path under pytest)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
import venv
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import typer
from sqlalchemy import select

from staleflow.config import LedgerConfig, ManagerConfig
from staleflow.ledger import Ledger, LedgerError
from staleflow.ports import free_port as planned_port
from staleflow.servers.schema import ts_groups_archive, ts_trajectories_archive
from staleflow.servers.trajectories.store import TrajectoryStore


def manager_config(tmp_path: Path, db_url: str | None = None, **ledger: object) -> ManagerConfig:
    return ManagerConfig(ledger=LedgerConfig(**{"eta": 1, "batch_size": 2, "group_size": 1, **ledger}),
                         state_dir=tmp_path, db_url=db_url, port=0)


def manager_and_trajectory_server(stack: ExitStack, tmp_path: Path, max_tokens: int, **ledger: int) -> tuple[str, str]:
    """A staleness manager and a trajectory server (sim rewards) on loopback for the rest of
    ``stack``, sharing ``ledger``'s settings; returns their URLs."""
    from staleflow.servers.http import serve_in_thread
    from staleflow.servers.manager import create_app as manager_app
    from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
    from staleflow.servers.trajectories import create_app as ts_app

    manager_url = stack.enter_context(serve_in_thread(manager_app(manager_config(tmp_path, **ledger)))).url
    ts_url = stack.enter_context(serve_in_thread(ts_app(TrajectoryServerConfig(
        ledger=LedgerConfig(**ledger), manager_url=manager_url, state_dir=tmp_path, reward="sim",
        sampling=SamplingConfig(max_tokens=max_tokens))))).url
    return manager_url, ts_url


def train_buffer_zero(ts_url: str, manager_url: str, route_and_run: Callable[[list[str]], None],
                      keep: str | None = None) -> list[str]:
    """Run two pending groups (not group ``keep``) through ``route_and_run`` (routed at V_traj 0
    and generated to completion) and consume buffer 0: the trainer version becomes 1, so a model
    version 1 may now exist (the trajectory server takes no segment of a newer one). Returns the
    groups consumed."""
    from staleflow.api.manager import ManagerClient
    from staleflow.api.trajectories import TrajectoryClient

    with TrajectoryClient(ts_url) as ts, ManagerClient(manager_url) as manager:
        groups: dict[str, list[str]] = {}
        for p in ts.pending().trajectories:
            groups.setdefault(p.group_id, []).append(p.traj_id)
        picked = [g for g in groups if g != keep][:2]
        route_and_run([t for g in picked for t in groups[g]])
        deadline = time.monotonic() + 30
        while manager.buffers().buffers[0].state != "ready":
            assert time.monotonic() < deadline, "buffer 0 did not fill"
            time.sleep(0.02)
        assert sorted(manager.consume().group_ids) == sorted(picked)
    return picked


def run_ledger_ops(ledger: Ledger, ops: list[tuple[str, int]]) -> Ledger:
    """Apply random operations (r: reserve at a version ``pick`` back, o: occupy, a: abort, c:
    consume; ``pick`` chooses among the live groups) and ignore the ones the ledger refuses: any
    reachable state."""
    eta = ledger.params.eta
    for n, (op, pick) in enumerate(ops):
        live = ledger.entries()
        try:
            if op == "r":
                ledger.reserve(f"g{n}", max(0, ledger.train_version - pick % (eta + 2)))
            elif op == "o" and live:
                ledger.occupy(live[pick % len(live)].group_id)
            elif op == "a" and live:
                ledger.abort(live[pick % len(live)].group_id)
            elif op == "c":
                ledger.consume()
        except LedgerError:
            pass
    return ledger


def free_port() -> int:
    """A loopback port for a server process the test starts later (below the ephemeral range: no
    outgoing connection takes it meanwhile)."""
    return planned_port("127.0.0.1")


def save_tiny_qwen2(directory: Path, tied: bool = True) -> Path:
    """A 2-layer Qwen2 with a 64-token vocabulary, seeded, saved as safetensors (needs the train extra)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def start_cli(*args: str, preexec_fn: Callable[[], None] | None = None, log: list[str] | None = None) -> subprocess.Popen:
    """Run ``staleflow ARGS`` as its own process; return once its socket listens (the log line
    comes after the bind, and requests queue in the backlog until the app serves them).
    ``preexec_fn`` runs in the child first (a resource limit); ``log`` collects its log lines."""
    proc = subprocess.Popen([sys.executable, "-m", "staleflow.cli", *args], stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)
    assert proc.stderr is not None
    seen = [] if log is None else log
    for line in proc.stderr:
        seen.append(line)
        if "listening on" in line:
            break
    else:
        raise AssertionError(f"`staleflow {' '.join(args)}` exited with {proc.wait()}:\n{''.join(seen[-20:])}")
    drain = proc.stderr.read if log is None else lambda: log.extend(proc.stderr or ())
    threading.Thread(target=drain, daemon=True).start()  # keep draining the pipe
    return proc


class ParamsProcess:
    """A parameter server in a process of its own on a fixed port and state directory, so that a
    test can SIGKILL it and start it again where its clients expect it."""

    def __init__(self, state_dir: Path, *options: str):
        self.state_dir = state_dir
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, persist: bool) -> None:
        self.proc = start_cli("serve", "params", "--state-dir", str(self.state_dir), "--port", str(self.port),
                              "--no-fsync", "--persist" if persist else "--no-persist", *self.options)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # a clean stop removes its shared-memory slots
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


ROOT = Path(__file__).resolve().parents[2]


def wheel_in_fresh_venv(tmp_path: Path) -> tuple[Path, str]:
    """Build StaleFlow's wheel from a copy of the checkout and install it into a fresh virtual
    environment outside it; the dependencies come from this interpreter's site-packages, after the
    environment's own (which holds the wheel). Returns the environment's python and the folder the
    wheel was installed into."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".staleflow", "results",
        ".ruff_cache"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("staleflow-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)  # this interpreter's pip installs into it (--python): no ensurepip
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, cwd=tmp_path)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
    return python, site


def calibrate_cli() -> typer.Typer:
    """``staleflow calibrate`` alone, as a Typer app for CliRunner."""
    from staleflow.cli.calibrate import register

    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """StaleFlow (test harness)."""

    register(app)
    return app


def group_state(store: TrajectoryStore, group_id: str) -> tuple[int | None, list[str]]:
    """A group's v_traj and its members' states, from the live store or, once it finished, the archive."""
    live = store.groups.get(group_id)
    if live is not None:
        return live.v_traj, [store.trajs[m].state.value for m in live.member_ids]
    with store.engine.connect() as conn:
        v_traj = conn.execute(select(ts_groups_archive.c.v_traj)
                              .where(ts_groups_archive.c.group_id == group_id)).scalar_one()
        states = conn.execute(select(ts_trajectories_archive.c.state)
                              .where(ts_trajectories_archive.c.group_id == group_id)).scalars().all()
    return v_traj, list(states)
