"""Supervision of a running job: restart a component that crashes or stops answering, in place,
and stop the job when one keeps crashing.

Every job ``staleflow up`` starts runs one ``Supervisor``, whichever launcher runs it: it drives
the launcher through ``staleflow.launch.launcher.Launcher`` (embedded threads, processes, Ray
actors). The fault harness (``staleflow.launch.faults``) only injects faults and measures what
this does. Detection is role-aware:

* every component: its process exited (crash, signal; on Ray, the actor's process died), or, for
  a component that is a thread of the job's own process, its server thread stopped (the embedded
  trainer: it raised);
* services (manager, trajectory server, parameter server, reward, coordinator, Ray's relays): its
  health probe failed ``probe_failures`` times in a row (hung). A service whose probe answers
  ``degraded`` is up and waits for a dependency (the trajectory server for its database): it is
  not hung, and is not restarted (``degraded`` lists them; the job pauses behind it);
* rollout instances: the coordinator declared the instance failed. The coordinator tells a slow
  instance (long generations: its snapshots still show progress) from a hung one (no answer to a
  snapshot or to a command the coordinator's cycle waits on for ``failure_timeout``, or no progress
  with work in hand for ``stall_timeout``).

Repair restarts only the failed component at its planned address, so the others reconnect by
themselves (their clients retry transient connection errors) and durable state (ledger,
trajectories, parameter versions, the trainer's step log and checkpoints) makes the restart
exact. How is the launcher's business: a process is killed if still alive and replaced, from a
warm standby when one is ready (``staleflow.launch.standby``: every role's code already
imported); a thread is asked to stop and served again; a Ray actor whose process died is being
restarted by Ray already (the launcher waits for it), a hung one is killed for Ray to restart.
A launcher may also ask for a restart (``request``): Ray's, when a service moved to another node
and its callers must read its new address. Components that failed together are restarted one at a
time on this machine (each restart takes the warm standby) and side by side on Ray (the
components of a lost node come back together).

A component that fails again within ``restart_window_s`` of its restart, more than
``max_restarts`` times in a row, is crash-looping: the job stops with an error naming it and its
log instead of restarting it forever.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from staleflow.api.base import ServiceClient, ServiceError
from staleflow.api.coordinator import CoordinatorClient
from staleflow.config import SupervisionConfig
from staleflow.launch import standby
from staleflow.launch.launcher import BeyondRepair, Launcher
from staleflow.launch.plan import TRAINER

log = logging.getLogger(__name__)

COORDINATOR_GRACE_S = 10.0  # after an instance restart, the coordinator's old verdict about it is ignored this long


@dataclass
class Restart:
    """One failure of a component and what the supervisor did about it (the report's ``restarts``)."""

    component: str
    kind: str  # "signal", "exit", "hung", "stopped" (a thread), "error" (the trainer raised), "moved" (Ray)
    cause: str  # e.g. "killed by SIGKILL", "exited with code 1", "3 health probes failed in a row"
    at_s: float  # when it was detected, seconds since the run started
    detected_after_s: float  # from the last sign of life (alive, probe answered, last snapshot) to detection
    recovered_after_s: float | None = None  # from the same moment until it answered again (None: not restarted)
    pid: int | None = None  # the new process (None: a thread of the job's process)
    log: str = ""  # where the component writes its log
    error: str | None = None  # why it was not restarted, or why the restart failed

    def to_json(self) -> dict:
        return asdict(self)


class Supervisor:
    """Watches a job's components and restarts only the one that failed."""

    def __init__(self, job: Launcher, settings: SupervisionConfig | None = None):
        self.job = job
        self.settings = settings or job.config.supervision
        self.restarts: list[Restart] = []
        self.counts: dict[str, int] = {}  # successful restarts per component
        self.events: list[dict] = []  # {"name", "event": "detected"|"restarted", "t": monotonic, ...}
        self.on_detected: list[Callable[[str, str, float], None]] = []
        self.on_restarted: list[Callable[[str, float], None]] = []
        self.failure: str | None = None  # set when a component is beyond repair: the job stops
        self.error: BaseException | None = None  # the supervisor itself failed (a bug): the job stops
        self._seen: dict[str, float] = {}  # last time each component was seen alive
        self._answered: dict[str, float] = {}  # last time each service answered its health probe
        self._misses: dict[str, int] = {}
        self.degraded: dict[str, str] = {}  # services up but waiting for a dependency, and which one
        self._back_at: dict[str, float] = {}  # when each component last came back from a restart
        self._in_a_row: dict[str, int] = {}  # failures in a row, each within the window of its restart
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self.warm_standby = self.settings.warm_standby and job.keeps_standby
        self._requests: list[tuple[str, str, str]] = []  # restarts a launcher asked for: (name, kind, cause)
        self._requests_lock = threading.Lock()
        self._standby: subprocess.Popen | None = None
        self._standby_log = None
        self._standbys = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Supervisor:
        now = time.monotonic()
        for name in self._watched():
            self._seen[name] = self._answered[name] = now
        self._new_standby()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the job is shutting down: nothing is restarted any more)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(90)
        if self._standby is not None:  # unused: it holds nothing, so it need not finish its imports
            self._standby.kill()
            self._standby.wait()
            assert self._standby.stdin is not None
            self._standby.stdin.close()
            self._standby = None

    @property
    def ready(self) -> bool:
        """A warm standby is ready to take the next failed role (or none is kept)."""
        return not self.warm_standby or (
            self._standby is not None and self._standby_log is not None and standby.ready(self._standby_log))

    def _new_standby(self) -> None:
        if self.warm_standby and not self._stopping():
            self._standbys += 1
            self._standby_log = self.job.state / "logs" / f"standby-{self._standbys}.log"
            self._standby = standby.spawn(self._standby_log)

    def _take_standby(self) -> subprocess.Popen | None:
        warm, self._standby = self._standby, None
        if warm is not None and warm.poll() is not None:
            return None  # the standby died: start cold
        return warm

    def request(self, name: str, kind: str, cause: str) -> None:
        """Restart component ``name`` on the next round, recorded like a failure (a launcher's ask:
        a service it calls moved)."""
        with self._requests_lock:
            self._requests.append((name, kind, cause))

    def _stopping(self) -> bool:
        return self._stop.is_set() or self.job.stop.is_set() or self.failure is not None

    # -- the watch -------------------------------------------------------------------------

    def _watched(self) -> list[str]:
        return self.job.components()

    def _run(self) -> None:
        clients: dict[str, ServiceClient | CoordinatorClient] = {}
        next_probe = 0.0
        try:
            while not self._stopping():
                failed = self._exited()
                failed += [asked for asked in self._requested() if asked[0] not in {f[0] for f in failed}]
                if not failed and time.monotonic() >= next_probe:
                    failed = self._hung(clients)
                    next_probe = time.monotonic() + self.settings.probe_interval_s
                detected = time.monotonic()  # all were detected now, whenever each is recovered
                if len(failed) > 1 and self.job.parallel_restarts:
                    self._recover_side_by_side(failed, detected)
                else:
                    for name, kind, cause, last_seen in failed:
                        if self._stopping():
                            break
                        self._recover(name, kind, cause, last_seen, detected)
                self._stop.wait(self.job.check_interval_s)  # exit-check pacing
        except BaseException as exc:  # stops the job: an unsupervised job must not pass for a supervised one
            self._failed(exc)
        finally:
            for c in clients.values():
                c.close()

    def _failed(self, exc: BaseException) -> None:
        self.error = exc
        self.failure = f"the supervisor failed: {exc!r}"
        log.exception("supervisor failed")
        self.job.stop.set()

    def _exited(self) -> list[tuple[str, str, str, float]]:
        gone = self.job.failed()
        now = time.monotonic()
        failed = []
        for name in self._watched():
            if name in gone:
                failed.append((name, *gone[name], self._seen.get(name, now)))
            else:
                self._seen[name] = now
        return failed

    def _requested(self) -> list[tuple[str, str, str, float]]:
        with self._requests_lock:
            asked, self._requests = self._requests, []
        now = time.monotonic()
        return [(name, kind, cause, now) for name, kind, cause in asked]

    def _client(self, clients: dict[str, ServiceClient | CoordinatorClient],
                name: str) -> ServiceClient | CoordinatorClient | None:
        """A probe client for component ``name`` at its URL now (a Ray component may have moved)."""
        url = self.job.endpoint(name)
        if url is None:
            return None
        client = clients.get(name)
        if client is None or client.url.rstrip("/") != url.rstrip("/"):
            if client is not None:
                client.close()
            kind = CoordinatorClient if name == "coordinator" else ServiceClient
            client = clients[name] = kind(url, token=self.job.token, timeout=self.settings.probe_timeout_s)
        return client

    def _hung(self, clients: dict[str, ServiceClient | CoordinatorClient]) -> list[tuple[str, str, str, float]]:
        failed = []
        for name in self._watched():
            if name.startswith("inst-") or name == TRAINER:
                continue  # instances: the coordinator's verdict (slow is not hung), below
            client = self._client(clients, name)
            if client is None:
                continue
            answer = self._probe(client)
            if answer is not None:
                self._answered[name] = time.monotonic()
                self._misses[name] = 0
                self._note_dependencies(name, answer)
                continue
            self._misses[name] = self._misses.get(name, 0) + 1
            if self._misses[name] >= self.settings.probe_failures:
                failed.append((name, "hung", f"{self._misses[name]} health probes failed in a row",
                               self._answered.get(name, time.monotonic())))
        if failed or "coordinator" not in clients:
            return failed
        for name, silent_s in self._declared_failed(clients["coordinator"]):
            if time.monotonic() - self._back_at.get(name, -1e9) > COORDINATOR_GRACE_S:
                failed.append((name, "hung", "the coordinator declared it failed", time.monotonic() - silent_s))
        return failed

    @staticmethod
    def _probe(client: ServiceClient | CoordinatorClient) -> dict | None:
        """The health answer (None: no answer, or an error)."""
        try:
            answer = client.health()
        except (httpx.HTTPError, ServiceError, ValueError):
            return None
        return answer if isinstance(answer, dict) else answer.model_dump()

    def _note_dependencies(self, name: str, answer: dict) -> None:
        """A service that answers "degraded" is up and waits for a dependency (its database): the job
        pauses behind it, and restarting it would not help, so it is not a failure. Logged when it
        starts and when it ends."""
        if answer.get("status") == "degraded":
            why = "; ".join(f"{k} {v}" for k, v in (answer.get("dependencies") or {}).items()) or "degraded"
            if name not in self.degraded:
                log.warning("supervisor: %s is up but a dependency is down (%s): not restarted; the job waits for it",
                            name, why)
                self.events.append({"name": name, "event": "degraded", "why": why, "t": time.monotonic()})
            self.degraded[name] = why
        elif self.degraded.pop(name, None) is not None:
            log.warning("supervisor: %s has its dependencies back", name)
            self.events.append({"name": name, "event": "recovered", "t": time.monotonic()})

    def _declared_failed(self, coordinator: ServiceClient | CoordinatorClient) -> list[tuple[str, float]]:
        """Instances the coordinator declared failed, with how long ago each was last heard of."""
        if not isinstance(coordinator, CoordinatorClient):
            return []
        try:
            listed = coordinator.instances().instances
        except (httpx.HTTPError, ServiceError, ValueError):
            return []
        watched = set(self._watched())
        found = []
        for i in listed:
            if i.status == "failed" and i.instance_id in watched:
                stamp = (i.snapshot or {}).get("timestamp")
                found.append((i.instance_id, max(0.0, time.time() - stamp) if stamp else 0.0))
        return found

    # -- repair ----------------------------------------------------------------------------

    def _recover_side_by_side(self, failed: list[tuple[str, str, str, float]], detected: float) -> None:
        """Recover each of ``failed`` in a thread of its own, for a launcher whose restarts mostly
        wait (Ray's: the components of a lost node come back together, elsewhere)."""

        def recover(name: str, kind: str, cause: str, last_seen: float) -> None:
            try:
                self._recover(name, kind, cause, last_seen, detected)
            except BaseException as exc:  # as in the watch itself: the job stops
                self._failed(exc)

        threads = [threading.Thread(target=recover, args=failure, name=f"supervisor-{failure[0]}", daemon=True)
                   for failure in failed]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _recover(self, name: str, kind: str, cause: str, last_seen: float, now: float) -> None:
        window = self.settings.restart_window_s
        back = self._back_at.get(name)
        self._in_a_row[name] = self._in_a_row.get(name, 0) + 1 if back is not None and now - back < window else 1
        record = Restart(component=name, kind=kind, cause=cause, at_s=now - self.job.started,
                         detected_after_s=max(0.0, now - last_seen), log=str(self.job.log_path(name)))
        self.events.append({"name": name, "event": "detected", "why": cause, "t": now})
        for hook in self.on_detected:
            hook(name, cause, now)
        if self._in_a_row[name] > self.settings.max_restarts:
            record.error = "crash loop: not restarted again"
            self.restarts.append(record)
            self._give_up(f"{name} keeps failing: {self._in_a_row[name]} failures in a row, each within "
                          f"{window:.0f} s of its restart (last: {cause}); see its log {record.log}")
            return
        log.warning("supervisor: %s failed (%s); restarting it", name, cause)
        try:
            pid = self.job.restart(name, standby=self._take_standby())
        except BeyondRepair as exc:
            record.error = str(exc)
            self.restarts.append(record)
            self._give_up(str(exc))
            return
        except Exception as exc:  # it died again while starting: counted, retried on the next check
            record.error = f"the restart failed: {exc}"
            self.restarts.append(record)
            self._back_at[name] = self._seen[name] = self._answered[name] = time.monotonic()
            self._new_standby()
            log.warning("supervisor: restarting %s failed: %s", name, exc)
            return
        self._new_standby()
        done = time.monotonic()
        record.recovered_after_s = done - last_seen
        record.pid = pid
        self.restarts.append(record)
        self._back_at[name] = self._seen[name] = self._answered[name] = done
        self._misses[name] = 0
        self.counts[name] = self.counts.get(name, 0) + 1
        self.events.append({"name": name, "event": "restarted", "t": done})
        log.warning("supervisor: %s is back after %.2f s", name, record.recovered_after_s)
        for hook in self.on_restarted:
            hook(name, done)

    def _give_up(self, message: str) -> None:
        log.error("supervisor: %s; stopping the job", message)
        self.failure = message
        self.job.stop.set()


class Supervised:
    """What a launcher's job reports of its supervision (``staleflow up``'s live view and summary)."""

    supervisor: Supervisor | None = None

    @property
    def failure(self) -> str | None:
        """Why supervision stopped the job (a component beyond repair), if it did."""
        return self.supervisor.failure if self.supervisor is not None else None

    @property
    def restarts(self) -> list[dict]:
        """Every failure the supervisor handled, in order (the report's ``restarts``)."""
        return [r.to_json() for r in self.supervisor.restarts] if self.supervisor is not None else []

    def supervise(self: Any) -> None:
        """Start the job's supervisor, if the job config asks for one."""
        if self.config.supervision.enabled:
            self.supervisor = Supervisor(self, self.config.supervision).start()
