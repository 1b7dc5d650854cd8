"""Verifiers in worker processes, each call under a deadline.

Every verifier runs here, the built-ins too: a response can make any parser slow, a thread cannot
be killed, and a thread that computes holds the interpreter lock the server's event loop needs
(health probes would fail while it runs); a process can be killed, and waiting on its pipe holds
nothing.
Each worker imports the configured verifiers once, then serves calls one at a time over a pipe.
When a call overruns its deadline the worker is killed (SIGKILL), the call scores 0 with reason
``"timeout"`` (counted in ``VerifierPool.timeouts``), and a fresh worker is started in the background to take its place.

Workers are started with the ``spawn`` method (a fork of a threaded server is unsafe). As with
any spawn pool, a program that builds the pool from a script must guard its entry point with
``if __name__ == "__main__":``; ``python -m staleflow.cli ...`` needs nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from staleflow.rewards.registry import BUILTIN_VERIFIERS, Verdict, VerifierError, load_function, run_verifier

TIMEOUT = "timeout"
"""The reason of an item whose verifier overran its deadline."""

log = logging.getLogger(__name__)


def _serve(conn: Connection, targets: Sequence[str]) -> None:
    """Worker process main loop."""
    loaded: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for target in targets:
        try:
            loaded[target] = BUILTIN_VERIFIERS.get(target) or load_function(target)
        except VerifierError as exc:
            errors[target] = str(exc)
    conn.send(("ready", errors))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        target, response_text, answer = message
        fn = loaded.get(target)
        verdict = run_verifier(fn, response_text, answer) if fn else Verdict(0.0, "error", f"verifier {target!r} not loaded")
        conn.send((verdict.reward, verdict.reason, verdict.detail))


class _Worker:
    def __init__(self, context: Any, targets: Sequence[str], start_timeout_s: float):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_conn, list(targets)), daemon=True,
                                       name="staleflow-verifier")
        self.process.start()
        child_conn.close()
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise VerifierError(f"a verifier worker did not start within {start_timeout_s:.0f} s")
        _, errors = self.conn.recv()
        if errors:
            self.kill()
            raise VerifierError("; ".join(errors.values()))

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
        self.conn.close()


class VerifierPool:
    """Calls verifiers (built-in names or ``"module:function"``) in ``workers`` processes, each
    call at most ``timeout_s``."""

    def __init__(self, targets: Sequence[str], workers: int = 2, timeout_s: float = 5.0, start_timeout_s: float = 60.0):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.targets = list(targets)
        self.workers = workers
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._restarts: list[threading.Thread] = []
        self.replaced = 0
        self.timeouts = 0
        with ThreadPoolExecutor(workers) as starter:
            for worker in starter.map(lambda _: self._new_worker(), range(workers)):
                self._idle.put(worker)
        self._callers = ThreadPoolExecutor(workers, thread_name_prefix="verifier-call")

    def _new_worker(self) -> _Worker:
        worker = _Worker(self._context, self.targets, self.start_timeout_s)
        with self._lock:
            if self._closed:
                worker.kill()
                raise VerifierError("the verifier pool is closed")
            self._live.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
            self.replaced += 1
        worker.kill()

        def start() -> None:
            try:
                self._idle.put(self._new_worker())
            except Exception as exc:
                if not self._closed:
                    log.error("could not replace a verifier worker: %s", exc)

        restart = threading.Thread(target=start, daemon=True, name="verifier-restart")
        with self._lock:
            self._restarts = [t for t in self._restarts if t.is_alive()] + [restart]
        restart.start()

    def call(self, target: str, response_text: str, answer: str) -> Verdict:
        if target not in self.targets:
            return Verdict(0.0, "error", f"verifier {target!r} is not configured")
        worker = self._idle.get()
        try:
            worker.conn.send((target, response_text, answer))
            if not worker.conn.poll(self.timeout_s):
                self._replace(worker)
                with self._lock:
                    self.timeouts += 1
                return Verdict(0.0, TIMEOUT, f"verifier {target} took longer than {self.timeout_s:g} s")
            reward, reason, detail = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._replace(worker)
            return Verdict(0.0, "error", f"verifier process died: {type(exc).__name__}")
        self._idle.put(worker)
        return Verdict(reward, reason, detail)

    def map(self, calls: Sequence[tuple[str, str, str]]) -> list[Verdict]:
        """Many calls at once, spread over the workers; results in order."""
        return list(self._callers.map(lambda c: self.call(*c), calls))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            restarts = list(self._restarts)
        for restart in restarts:  # a worker still starting would outlive us otherwise
            restart.join(self.start_timeout_s)
        with self._lock:
            live = list(self._live)
            self._live.clear()
        self._callers.shutdown(wait=False, cancel_futures=True)
        for worker in live:
            worker.kill()
