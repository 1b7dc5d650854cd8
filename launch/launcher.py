"""The one interface every launcher offers, so that one supervisor (``staleflow.launch.supervisor``)
keeps any job running, wherever its components run.

Two launchers implement it:

* ``staleflow.launch.local.LocalJob``: this machine; each component a thread of the job's own process
  (embedded) or a process of its own (``--processes``, and always a vLLM instance or the FSDP
  trainer), the two mixed within one job;
* ``staleflow.launch.ray.job.RayClusterJob``: each component a Ray actor, the trainer a gang
  of rank actors. Ray's own actor restart is how a dead process comes back there; the supervisor
  decides when a component has failed, waits for (or asks for) its restart and records it.

A component is named as in the job (``manager``, ``params``, ``reward``, ``ts``, ``inst-N``,
``coordinator``, ``trainer``; Ray adds ``relay-N``). The supervisor asks ``failed()`` every
``check_interval_s`` (a process or thread gone), probes every component that has an
``endpoint()`` for health (a hung one), and repairs with ``restart()``; a launcher raises
``BeyondRepair`` for a component it cannot restart, which stops the job with that message.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from staleflow.config import JobConfig


class BeyondRepair(RuntimeError):
    """The launcher cannot restart this component; the message says why and what to do."""


class ComponentStuck(BeyondRepair):
    """A component that is a thread of this process did not stop: it cannot be restarted here."""


def exit_cause(returncode: int) -> tuple[str, str]:
    """(kind, cause) of a process that exited with ``returncode``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return "signal", f"killed by {name}"
    return "exit", f"exited with code {returncode}"


@runtime_checkable
class Launcher(Protocol):
    """What the supervisor needs of a launcher: start, stop and restart one component, where it
    answers, where it logs, and which components are gone."""

    config: JobConfig
    state: Path  # the run's state directory
    stop: threading.Event  # set once the job is stopping: nothing is restarted any more
    started: float  # time.monotonic() when the run's clock started
    token: str  # the run's bearer token, for the supervisor's probes
    check_interval_s: float  # how often ``failed()`` is asked
    keeps_standby: bool  # a warm standby process (``staleflow.launch.standby``) can take a failed role
    parallel_restarts: bool  # components that failed together are restarted side by side

    def components(self) -> list[str]:
        """Every component the supervisor watches, the trainer included."""
        ...

    def failed(self) -> dict[str, tuple[str, str]]:
        """The components whose process or thread is gone now, each with (kind, cause); every
        other component is alive. A trainer that finished its steps is not failed."""
        ...

    def endpoint(self, name: str) -> str | None:
        """The URL component ``name`` answers ``/v1/health`` at now (None: it serves nothing)."""
        ...

    def log_path(self, name: str) -> Path:
        """Where component ``name`` writes its log."""
        ...

    def start_component(self, name: str, standby: Any = None) -> int | None:
        """Start component ``name`` at its planned address and return once it answers; its new
        process id (None: a thread of this process). A warm ``standby`` may take the role."""
        ...

    def stop_component(self, name: str) -> None:
        """Stop component ``name`` for good (``ComponentStuck`` if it cannot be stopped)."""
        ...

    def restart(self, name: str, standby: Any = None) -> int | None:
        """Bring the failed component ``name`` back at its planned address; its new process id
        (None: a thread). Raises ``BeyondRepair`` if it cannot be brought back."""
        ...
